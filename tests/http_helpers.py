"""Third-party consumers (gnsq, pynsq) run in a subprocess with a hard timeout, for the HTTP API tests:
what a message published over HTTP looks like to the clients NSQ users run. Processes are started by
tests/processes.py."""

from __future__ import annotations

import json
import subprocess
import sys


# --- third-party consumers ----------------------------------------------------------------------

_CONSUMER_COMMON = r"""
import base64, json, sys, time
spec = json.loads(sys.argv[1])
received = []
start = time.monotonic()
def record(body, attempts):
    received.append({"body": base64.b64encode(bytes(body)).decode(), "attempts": attempts,
                     "at": time.monotonic() - start})
def done():
    return len(received) >= spec["expect"] or time.monotonic() - start > spec["max_seconds"]
def report():
    sys.stdout.write("RESULT " + json.dumps({"messages": received}) + "\n")
    sys.stdout.flush()
"""

CONSUMER_SCRIPTS = {
    "gnsq": _CONSUMER_COMMON + r"""
import logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import gevent, gnsq
consumer = gnsq.Consumer(spec["topic"], spec["channel"], nsqd_tcp_addresses=[spec["address"]],
                         max_in_flight=100)
@consumer.on_message.connect
def handler(consumer, message):
    record(message.body, message.attempts)
consumer.start(block=False)
while not done():
    gevent.sleep(0.02)
gevent.sleep(spec.get("quiet", 0.3))  # duplicates would show up here
consumer.close()
report()
""",
    "pynsq": _CONSUMER_COMMON + r"""
import logging
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import tornado.ioloop, nsq
loop = tornado.ioloop.IOLoop.current()
def handler(message):
    record(message.body, message.attempts)
    return True
reader = nsq.Reader(topic=spec["topic"], channel=spec["channel"], message_handler=handler,
                    nsqd_tcp_addresses=[spec["address"]], max_in_flight=100)
def check():
    if done():
        loop.call_later(spec.get("quiet", 0.3), finish)
    else:
        loop.call_later(0.02, check)
def finish():
    reader.close()
    report()
    loop.stop()
loop.call_later(0.02, check)
loop.start()
""",
}


def consume(lib: str, address: str, topic: str, channel: str, expect: int, max_seconds: float = 15.0) -> list[dict]:
    """Run a third-party consumer until it got `expect` messages (or max_seconds); its records."""
    spec = {"address": address, "topic": topic, "channel": channel, "expect": expect, "max_seconds": max_seconds}
    proc = subprocess.run([sys.executable, "-c", CONSUMER_SCRIPTS[lib], json.dumps(spec)],
                          capture_output=True, timeout=max_seconds + 20, stdin=subprocess.DEVNULL)
    lines = [line for line in proc.stdout.decode(errors="replace").splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{lib} consumer failed ({proc.returncode}):\n{proc.stdout.decode(errors='replace')[-3000:]}\n"
        f"{proc.stderr.decode(errors='replace')[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULT "):])["messages"]
