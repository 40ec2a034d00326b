"""Helpers for test_fuzz.py and test_http_fuzz.py: hypothesis strategies that build NSQ byte streams (TCP V2,
lookupd V1, HTTP/1.1), a Trio driver that plays many of them at once against a server and reports how
each connection ended, checks on what the broker answered, and a canary that measures whether ordinary
clients are still served while all this goes on.

A stream starts as a valid command sequence (each command's line and body built from its parts, with
the sizes right) and is then mutated: bytes flipped, inserted, deleted, the stream cut short, a length
field replaced by an extreme one, a slice duplicated. Streams can also be upgraded first (IDENTIFY with
snappy, deflate or tls_v1) so that the compressed and TLS paths meet garbage too.
"""

from __future__ import annotations

import json
import random
import ssl
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field

import snappy
import trio
from hypothesis import strategies as st

from nsq_raw import RawNSQ

_SIZE = struct.Struct(">i")

# ---------------------------------------------------------------------------------------------
# TCP protocol V2
# ---------------------------------------------------------------------------------------------

MAGIC_V2 = b"  V2"

# valid, invalid and borderline names (64 is the limit, '#ephemeral' a suffix, '.' allowed)
NAMES = st.sampled_from([
    b"fuzz", b"fuzz2", b"fuzz#ephemeral", b"f" * 64, b"f" * 65, b"", b"bad/name", b"\xff\xfe", b"a b",
    b".", b"-_.", b"x#ephemeral#ephemeral", b"#ephemeral", b"fuzz\r",
])
EXTREME_INTS = st.sampled_from([0, 1, -1, 999, 1000, 2500, 2501, 60000, 2**31 - 1, 2**31, -(2**31), 2**63, 2**64])
INTS = st.one_of(EXTREME_INTS, st.integers(-(2**40), 2**40))
INT_TEXT = st.one_of(INTS.map(lambda i: str(i).encode()), st.binary(max_size=6), st.sampled_from([b"", b"+1", b" 1", b"1e3"]))
BODIES = st.one_of(st.binary(max_size=48), st.sampled_from([b"", b"x" * 5000, b"\x00" * 26]))
MSG_IDS = st.one_of(
    st.text(alphabet="0123456789abcdef", min_size=16, max_size=16).map(str.encode),
    st.binary(min_size=16, max_size=16),
    st.binary(max_size=20),
)
IDENTIFY_KEYS = [
    "client_id", "hostname", "feature_negotiation", "heartbeat_interval", "output_buffer_size",
    "output_buffer_timeout", "tls_v1", "snappy", "deflate", "deflate_level", "sample_rate", "user_agent",
    "msg_timeout", "short_id", "long_id", "unknown",
]
JSON_VALUES = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=8), st.lists(st.integers(), max_size=2))
IDENTIFY_BODIES = st.one_of(
    st.dictionaries(st.sampled_from(IDENTIFY_KEYS), JSON_VALUES, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=32),
    st.sampled_from([b"null", b"[]", b"{", b'{"heartbeat_interval": "1000"}', b'"x"']),
)


def line(*parts: bytes) -> bytes:
    return b" ".join(parts) + b"\n"


def with_body(head: bytes, body: bytes, size: int | None = None) -> bytes:
    return head + _SIZE.pack(len(body) if size is None else size) + body


def mpub_body(bodies: list[bytes], count: int | None = None) -> bytes:
    out = _SIZE.pack(len(bodies) if count is None else count)
    return out + b"".join(_SIZE.pack(len(b)) + b for b in bodies)


# a body's size field is usually right, sometimes a lie (too big, negative, zero)
SIZE_LIES = st.one_of(st.none(), st.none(), st.none(), st.sampled_from([0, -1, 1, 2**31 - 1, 6 * 1024 * 1024]),
                      st.integers(0, 200))

V2_COMMANDS = st.one_of(
    st.builds(lambda b, s: with_body(b"IDENTIFY\n", b, s), IDENTIFY_BODIES, SIZE_LIES),
    st.builds(lambda b, s: with_body(b"AUTH\n", b, s), st.binary(max_size=16), SIZE_LIES),
    st.builds(lambda t, c: line(b"SUB", t, c), NAMES, NAMES),
    st.builds(lambda t, b, s: with_body(line(b"PUB", t), b, s), NAMES, BODIES, SIZE_LIES),
    st.builds(lambda t, bs, n, s: with_body(line(b"MPUB", t), mpub_body(bs, n), s),
              NAMES, st.lists(BODIES, max_size=4), st.one_of(st.none(), INTS.filter(lambda i: -(2**31) <= i < 2**31)), SIZE_LIES),
    st.builds(lambda t, d, b, s: with_body(line(b"DPUB", t, d), b, s), NAMES, INT_TEXT, BODIES, SIZE_LIES),
    st.builds(lambda n: line(b"RDY", n), INT_TEXT),
    st.builds(lambda i: line(b"FIN", i), MSG_IDS),
    st.builds(lambda i, t: line(b"REQ", i, t), MSG_IDS, INT_TEXT),
    st.builds(lambda i: line(b"TOUCH", i), MSG_IDS),
    st.sampled_from([b"CLS\n", b"NOP\n", b"NOP\r\n", b"RDY\n", b"SUB\n", b"PUB\n", b"FIN\n", b"\n", b" \n"]),
    st.builds(lambda n, p: line(n, *p), st.binary(min_size=1, max_size=8).filter(lambda b: b"\n" not in b),
              st.lists(st.binary(max_size=6), max_size=3)),
    st.binary(max_size=40),
)

# (op, where in the stream as a fraction, bytes, length)
MUTATIONS = st.lists(
    st.tuples(st.integers(0, 6), st.floats(0, 1), st.binary(min_size=1, max_size=8), st.integers(1, 24)),
    max_size=4,
)
LENGTH_FIELDS = [b"\x7f\xff\xff\xff", b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x00\x10\x00\x00", b"\x80\x00\x00\x00"]


def mutate(data: bytes, mutations: list[tuple[int, float, bytes, int]]) -> bytes:
    buf = bytearray(data)
    for op, where, payload, n in mutations:
        pos = min(len(buf), int(where * (len(buf) + 1)))
        if op == 0 and buf:  # overwrite
            buf[pos : pos + len(payload)] = payload
        elif op == 1:  # insert
            buf[pos:pos] = payload
        elif op == 2:  # delete
            del buf[pos : pos + n]
        elif op == 3:  # cut the stream short
            del buf[pos:]
        elif op == 4:  # an extreme length field
            buf[pos:pos] = LENGTH_FIELDS[n % len(LENGTH_FIELDS)]
        elif op == 5:  # duplicate a slice
            buf[pos:pos] = buf[pos : pos + n]
        else:  # a newline or space where it does not belong
            buf[pos:pos] = b"\n" if n % 2 else b" "
    return bytes(buf)


def random_mutations(rng: random.Random, pieces: list[bytes]) -> list[tuple[int, float, bytes, int]]:
    """1–6 edits for mutate() drawn from a seeded rng, for the fuzzers that replay a fixed list of cases:
    what an edit overwrites or inserts is random bytes or one of `pieces` (a command, a header...)."""
    return [
        (rng.randrange(7), rng.random(),
         rng.choice(pieces) if pieces and rng.random() < 0.5 else rng.randbytes(rng.randint(1, 8)),
         rng.randint(1, 24))
        for _ in range(rng.randint(1, 6))
    ]


def snappy_encode(data: bytes) -> bytes:
    return snappy.StreamCompressor().compress(data)


def deflate_encode(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)


def client_hello() -> bytes:
    """A real TLS ClientHello (from an SSLObject on memory BIOs), for mutating."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


CLIENT_HELLO = client_hello()


@dataclass(frozen=True)
class Case:
    data: bytes
    kind: str  # "plain", "snappy", "deflate", "tls", "random"
    half_close: bool = True


def _upgraded(kind: str, commands: bytes, mutations) -> Case:
    ident = json.dumps({"feature_negotiation": True, kind if kind != "tls" else "tls_v1": True}).encode()
    head = MAGIC_V2 + with_body(b"IDENTIFY\n", ident)
    if kind == "snappy":
        tail = snappy_encode(commands)
    elif kind == "deflate":
        tail = deflate_encode(commands)
    else:
        tail = CLIENT_HELLO
    return Case(head + mutate(tail, mutations), kind)


def weighted(*pairs):
    """One of the strategies, chosen with the given weights (st.one_of would treat them alike)."""
    total = sum(w for w, _ in pairs)

    def pick(n: int):
        for w, strategy in pairs:
            if n < w:
                return strategy
            n -= w
        raise AssertionError(n)

    return st.integers(0, total - 1).flatmap(pick)


PLAIN_CASES = st.builds(
    lambda magic, cmds, muts: Case(magic + mutate(b"".join(cmds), muts), "plain"),
    weighted((9, st.just(MAGIC_V2)), (1, st.sampled_from([b"  V1", b"GET ", b"", b"\x00\x00\x00\x00"]))),
    st.lists(V2_COMMANDS, min_size=1, max_size=6),
    MUTATIONS,
)
UPGRADED_CASES = st.builds(_upgraded, st.sampled_from(["snappy", "deflate", "tls"]),
                           st.lists(V2_COMMANDS, min_size=1, max_size=4).map(b"".join), MUTATIONS)
RANDOM_CASES = st.builds(lambda magic, data: Case(magic + data, "random"),
                         st.sampled_from([MAGIC_V2, b""]), st.binary(max_size=300))

V2_CASES = weighted((6, PLAIN_CASES), (3, UPGRADED_CASES), (1, RANDOM_CASES))


# ---------------------------------------------------------------------------------------------
# what the broker answered
# ---------------------------------------------------------------------------------------------

KNOWN_ERRORS = {
    "E_INVALID", "E_BAD_BODY", "E_BAD_TOPIC", "E_BAD_CHANNEL", "E_BAD_MESSAGE", "E_PUB_FAILED", "E_MPUB_FAILED",
    "E_DPUB_FAILED", "E_FIN_FAILED", "E_REQ_FAILED", "E_TOUCH_FAILED", "E_AUTH_FAILED", "E_UNAUTHORIZED",
    "E_AUTH_FIRST", "E_AUTH_DISABLED", "E_IDENTIFY_FAILED", "E_SUB_FAILED", "E_BAD_PROTOCOL",
}
NON_FATAL = {"E_FIN_FAILED", "E_REQ_FAILED", "E_TOUCH_FAILED"}


def check_v2_answer(data: bytes) -> str | None:
    """What is wrong with the bytes the broker sent on a plain V2 connection, or None.

    Every frame is well-formed; error codes are nsqd's; a fatal error is the last frame; a message frame
    holds a 16-character hex id. Checking stops where the connection is upgraded (TLS, snappy, deflate).
    """
    pos = 0
    fatal_seen = None
    while len(data) - pos >= 4:
        (size,) = _SIZE.unpack_from(data, pos)
        if size < 4:
            return f"invalid frame size {size} at {pos}"
        if len(data) - pos - 4 < size:
            return None  # cut short by the close: fine (the peer half-closed, the rest was never wanted)
        frame_type = _SIZE.unpack_from(data, pos + 4)[0]
        body = data[pos + 8 : pos + 4 + size]
        pos += 4 + size
        if fatal_seen is not None:
            return f"frame after the fatal error {fatal_seen!r}: {body[:60]!r}"
        if frame_type == 0:
            if body.startswith(b"{"):
                try:
                    info = json.loads(body)
                except ValueError:
                    return f"response is not JSON: {body[:80]!r}"
                if info.get("tls_v1") or info.get("snappy") or info.get("deflate"):
                    return None  # what follows is encoded
        elif frame_type == 1:
            code = body.split(b" ", 1)[0].decode(errors="replace")
            if code not in KNOWN_ERRORS:
                return f"unknown error code {body[:80]!r}"
            if code not in NON_FATAL:
                fatal_seen = body
        elif frame_type == 2:
            if size < 4 + 26:
                return f"message frame too short ({size})"
            msg_id = body[10:26]
            if not all(c in b"0123456789abcdef" for c in msg_id):
                return f"message id {msg_id!r} is not hex"
        else:
            return f"unknown frame type {frame_type}"
    return None


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    received: bytes = b""
    closed: bool = False  # the server closed the connection (EOF or reset) within the timeout
    seconds: float = 0.0


async def _exchange(host: str, port: int, data: bytes, half_close: bool, timeout: float, chunk: int) -> Outcome:
    outcome = Outcome()
    received = bytearray()
    start = trio.current_time()
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            outcome.closed = True  # refused: an answer too (never seen so far)
            return outcome
        async with stream:
            try:
                # sent in pieces, so the server sees commands split at arbitrary points
                for i in range(0, len(data), chunk):
                    await stream.send_all(data[i : i + chunk])
                if half_close:
                    await stream.send_eof()
                while True:
                    got = await stream.receive_some(65536)
                    if not got:
                        break
                    received += got
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # the server closed first (a reset): that ends the case as well
            outcome.closed = True
    outcome.received = bytes(received)
    outcome.seconds = trio.current_time() - start
    return outcome


async def play(address: tuple[str, int], cases: list[tuple[bytes, bool]], *, timeout: float = 10.0,
               limit: int = 64, chunk: int = 997) -> list[Outcome]:
    """Play every (data, half_close) on its own connection, `limit` at a time; each gets `timeout`."""
    results: list[Outcome | None] = [None] * len(cases)
    sem = trio.Semaphore(limit)

    async def one(i: int, data: bytes, half_close: bool) -> None:
        async with sem:
            results[i] = await _exchange(address[0], address[1], data, half_close, timeout, chunk)

    async with trio.open_nursery() as nursery:
        for i, (data, half_close) in enumerate(cases):
            nursery.start_soon(one, i, data, half_close)
    return results  # type: ignore[return-value]


def play_sync(address: tuple[str, int], cases: list[tuple[bytes, bool]], **kwargs) -> list[Outcome]:
    return trio.run(lambda: play(address, cases, **kwargs))


# ---------------------------------------------------------------------------------------------
# the canary: an ordinary producer and consumer, timed, while the broker is under attack
# ---------------------------------------------------------------------------------------------


@dataclass
class Canary:
    """Publishes a message every `period` and waits for it on a consumer; records each round trip."""

    address: str
    topic: str = "canary"
    period: float = 0.02
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Canary:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        try:
            with RawNSQ(self.address, timeout=10) as consumer, RawNSQ(self.address, timeout=10) as producer:
                consumer.identify(heartbeat_interval=5000)
                consumer.sub(self.topic, "ch")
                consumer.rdy(10)
                i = 0
                while not self._stop.is_set():
                    body = b"%d" % i
                    start = time.monotonic()
                    producer.pub(self.topic, body)
                    msg = consumer.expect_message(timeout=10)
                    consumer.fin(msg.id)
                    self.latencies.append(time.monotonic() - start)
                    if msg.body != body:
                        self.errors.append(f"expected {body!r}, got {msg.body!r}")
                    i += 1
                    self._stop.wait(self.period)
        except Exception as exc:  # reported by the test
            self.errors.append(repr(exc))

    def summary(self) -> str:
        if not self.latencies:
            return f"no round trips, errors {self.errors}"
        lat = sorted(self.latencies)
        return (f"{len(lat)} round trips, median {lat[len(lat) // 2] * 1000:.1f} ms, "
                f"p99 {lat[int(len(lat) * 0.99)] * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms")


def assert_canary(canary: Canary) -> None:
    assert not canary.errors, canary.errors
    assert len(canary.latencies) >= 20, canary.summary()
    # other clients are served throughout: no round trip took more than a second
    assert max(canary.latencies) < 1.0, canary.summary()


def excerpt(log: str, needles: tuple[str, ...]) -> str:
    """The part of a log around the first of `needles` found, for an assertion's message."""
    for needle in needles:
        i = log.find(needle)
        if i >= 0:
            return log[max(0, i - 2000) : i + 2000]
    return ""
