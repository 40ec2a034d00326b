"""Consume with pynsq, the reference Python client (tornado), to show any NSQ client works.

    python examples/consume_pynsq.py [count]      # against `make run` (127.0.0.1:4150)
"""

import os
import sys

import nsq
import tornado.ioloop

NSQD_TCP = os.environ.get("NSQD_TCP", "127.0.0.1:4150")
TOPIC = os.environ.get("TOPIC", "example")
COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 1
seen = []


def handler(message):
    seen.append(message.body)
    print("pynsq received:", message.body.decode(errors="replace"), flush=True)
    if len(seen) >= COUNT:
        tornado.ioloop.IOLoop.current().add_callback(tornado.ioloop.IOLoop.current().stop)
    return True


nsq.Reader(TOPIC, "pynsq-example", message_handler=handler, nsqd_tcp_addresses=[NSQD_TCP], max_in_flight=10)
tornado.ioloop.IOLoop.current().call_later(30, tornado.ioloop.IOLoop.current().stop)
nsq.run()
sys.exit(0 if len(seen) >= COUNT else 1)
