"""A whole conversation with the broker through a third-party client, run as a subprocess:
``python thirdparty_conversation.py '<spec json>'``; prints ``RESULT <json>`` last.

Used by test_tls_compression_auth.py. Each client runs in its own process (tornado's loop for pynsq,
gevent's monkeypatching for gnsq), so neither can hang or leak into pytest.

spec:
  client     "pynsq" (publishes with nsq.Writer, then consumes with nsq.Reader) or "gnsq" (consumes
             only, with gnsq.Consumer: gnsq's Producer cannot use TLS/snappy/deflate against any nsqd,
             Go's included — it loses the upgrade's OK frame — so the test publishes for it)
  address    "host:port" of the broker's TCP port
  topic, channel
  seed, count, scale  the messages: `bodies(seed, count, scale)` below, the same in the test
  conn       keyword arguments for the client's connections (tls_v1, snappy, deflate, deflate_level,
             auth_secret, heartbeat_interval, ...); "tls_options" may name files: ca_certs, certfile,
             keyfile; cert_reqs is set to CERT_REQUIRED when ca_certs is given
  stats_url  optional: /stats?format=json URL read while the consumer is still connected
  ca         optional CA file for an https stats_url

RESULT: {"published": [responses], "received": n, "digests": sorted sha256 hex of received bodies,
         "stats_clients": [client stats of the channel, read while connected], "errors": [...]}
"""

from __future__ import annotations

import hashlib
import json
import random
import ssl
import sys
import time
import urllib.request


def bodies(seed: int, count: int, scale: float = 1.0) -> list[bytes]:
    """Messages of very different shapes: tiny, compressible, bigger than one 64 KiB snappy chunk,
    incompressible (random), each starting with its index so they are all distinct. `scale` shrinks
    the big ones."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = i % 5
        head = b"%06d:" % i
        if kind == 0:
            out.append(head)
        elif kind == 1:
            out.append(head + b"compressible " * rng.randint(10, 400))
        elif kind == 2:
            out.append(head + b"z" * int(rng.randint(70_000, 200_000) * scale))  # several snappy chunks
        elif kind == 3:
            out.append(head + rng.randbytes(int(rng.randint(1, 100_000) * scale)))  # does not compress
        else:
            out.append(head + json.dumps({"i": i, "v": rng.random()}).encode())
    return out


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _tls_options(spec_opts: dict | None) -> dict | None:
    if not spec_opts:
        return None
    opts = dict(spec_opts)
    if "ca_certs" in opts:
        opts.setdefault("cert_reqs", ssl.CERT_REQUIRED)
    return opts


def read_stats(spec: dict) -> list[dict]:
    url = spec.get("stats_url")
    if not url:
        return []
    context = ssl.create_default_context(cafile=spec["ca"]) if spec.get("ca") else None
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        data = json.loads(response.read())
    for topic in data.get("topics", []):
        if topic["topic_name"] == spec["topic"]:
            for channel in topic["channels"]:
                if channel["channel_name"] == spec["channel"]:
                    return channel["clients"]
    return []


def run_pynsq(spec: dict) -> dict:
    import tornado.ioloop
    import nsq

    loop = tornado.ioloop.IOLoop.current()
    conn = dict(spec.get("conn", {}))
    if "tls_options" in conn:
        conn["tls_options"] = _tls_options(conn["tls_options"])
    msgs = bodies(spec["seed"], spec["count"], spec.get("scale", 1.0))
    result: dict = {"published": [], "received": 0, "digests": [], "stats_clients": [], "errors": []}
    received: list[str] = []
    finished = {"done": False}

    def done(**extra) -> None:
        if finished["done"]:
            return
        finished["done"] = True
        result.update(extra)
        loop.stop()

    writer = nsq.Writer([spec["address"]], **conn)
    pending = {"n": 0}

    def published(conn_, data) -> None:
        if isinstance(data, Exception):
            result["errors"].append("publish: " + repr(data))
            return done()
        result["published"].append(data.decode())
        pending["n"] -= 1
        if pending["n"] == 0:
            start_reader()

    def publish() -> None:
        if not any(c.connected() for c in writer.conns.values()):
            return loop.call_later(0.05, publish)
        small = [m for m in msgs if len(m) < 10_000]
        big = [m for m in msgs if len(m) >= 10_000]
        pending["n"] = (1 if small else 0) + len(big)
        if small:
            writer.mpub(spec["topic"], small, callback=published)
        for m in big:
            writer.pub(spec["topic"], m, callback=published)

    def start_reader() -> None:
        def handler(message) -> bool:
            received.append(digest(bytes(message.body)))
            if len(received) == len(msgs):
                # still connected: read what the broker says about this connection, then stop
                loop.call_later(0.3, finish)
            return True

        def finish() -> None:
            try:
                result["stats_clients"] = read_stats(spec)
            except Exception as exc:  # reported, not raised: the test decides
                result["errors"].append("stats: " + repr(exc))
            done()

        nsq.Reader(spec["topic"], spec["channel"], message_handler=handler,
                   nsqd_tcp_addresses=[spec["address"]], max_in_flight=20, **conn)

    loop.call_later(0.05, publish)
    loop.call_later(spec.get("timeout", 25), lambda: done(timeout=True))
    loop.start()
    result["received"] = len(received)
    result["digests"] = sorted(received)
    return result


def run_gnsq(spec: dict) -> dict:
    from gevent import monkey

    monkey.patch_all()
    import gevent
    import gnsq

    conn = dict(spec.get("conn", {}))
    if "tls_options" in conn:
        conn["tls_options"] = _tls_options(conn["tls_options"])
    result: dict = {"published": [], "received": 0, "digests": [], "stats_clients": [], "errors": []}
    received: list[str] = []
    consumer = gnsq.Consumer(spec["topic"], spec["channel"], nsqd_tcp_addresses=[spec["address"]],
                             max_in_flight=20, **conn)

    @consumer.on_message.connect
    def handler(consumer, message) -> None:
        received.append(digest(bytes(message.body)))

    @consumer.on_error.connect
    def error(consumer, error) -> None:
        result["errors"].append("consumer: " + repr(error))

    consumer.start(block=False)
    deadline = time.monotonic() + spec.get("timeout", 25)
    while len(received) < spec["count"] and time.monotonic() < deadline:
        gevent.sleep(0.05)
    gevent.sleep(0.3)
    try:
        result["stats_clients"] = read_stats(spec)
    except Exception as exc:
        result["errors"].append("stats: " + repr(exc))
    consumer.close()
    result["received"] = len(received)
    result["digests"] = sorted(received)
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = run_pynsq(spec) if spec["client"] == "pynsq" else run_gnsq(spec)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
