"""Protocol V2 (broker/protocol_v2.py) in-process, under trio's MockClock: exact times, no waiting.

A real NSQD runs in the test's nursery (HTTP off) and connections are handed straight to the broker
the way its TCP accept loop hands them over, by one of two paths:

- memory: a `trio.testing` memory stream, served by ProtocolV2's own tasks (io_loop reads the stream;
  a stream with no fd is never parked in the V2Poller);
- socket: one end of a `socket.socketpair()` through NSQD._handle_tcp (the protocol magic first), so a
  connection waits in the V2Poller between its reads and is served in place (os.read of its fd).

A consumer that does not read is a lockstep memory stream (a write waits until the peer reads it) or a
socketpair with small buffers.

The client's side sends what shared.protocol encodes and reads frames with its FrameParser. Covered:
heartbeats and the read deadline, msg_timeout and TOUCH, RDY edge cases, the output buffer and a
consumer that does not read, pipelined and split commands, errors mid-stream. The expectations are
those the process tests check against Go nsqd (tests/test_broker_clients.py), here with exact times.
"""

from __future__ import annotations

import json
import socket

import pytest
import trio
import trio.testing

from trio_nsq.broker.nsqd import NSQD
from trio_nsq.broker.options import Options
from trio_nsq.shared import protocol

PATHS = ["memory", "socket"]
UNKNOWN_ID = b"0" * 16


def response(data: bytes) -> tuple[int, bytes]:
    return protocol.FRAME_TYPE_RESPONSE, data


def error(text: str) -> tuple[int, bytes]:
    return protocol.FRAME_TYPE_ERROR, text.encode()


class Closed(Exception):
    """The broker closed the connection."""


class Peer:
    """The client's end of one connection: sends encoded commands, reads frames (each at a mock time:
    `at` is the time the last frame was read)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.parser = protocol.FrameParser()
        self.at = 0.0
        self.ended = trio.Event()  # set when the broker is done with the connection, at ended_at
        self.ended_at = 0.0
        self.writes: list[tuple[float, list[tuple[int, bytes]]]] = []  # the broker's (memory paths)

    async def send(self, *commands: bytes) -> None:
        await self.stream.send_all(b"".join(commands))

    async def frame(self) -> tuple[int, bytes]:
        while (frame := self.parser.next_frame()) is None:
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:  # a socket reset by the broker's close
                data = b""
            if not data:
                raise Closed()
            self.parser.feed(data)
        self.at = trio.current_time()
        return frame

    async def frames(self, n: int) -> list[tuple[int, bytes]]:
        return [await self.frame() for _ in range(n)]

    async def message(self) -> protocol.DecodedMessage:
        """The next message; heartbeats before it are answered with NOP, as clients do."""
        while (frame := await self.frame()) == response(protocol.HEARTBEAT):
            await self.send(protocol.encode_nop())
        frame_type, data = frame
        assert frame_type == protocol.FRAME_TYPE_MESSAGE, (frame_type, data)
        return protocol.decode_message(data)

    async def messages(self, n: int) -> list[protocol.DecodedMessage]:
        return [await self.message() for _ in range(n)]

    async def until_closed(self) -> list[tuple[int, bytes]]:
        """Every frame up to the broker's close; `at` is then the time it closed."""
        got = []
        while True:
            try:
                got.append(await self.frame())
            except Closed:
                self.at = trio.current_time()
                return got

    async def nothing_for(self, seconds: float, *, heartbeats: bool = True) -> None:
        """No frame for `seconds`, but heartbeats (answered with NOP, as clients do) when allowed."""
        with trio.move_on_after(seconds):
            while True:
                frame = await self.frame()
                if not heartbeats or frame != response(protocol.HEARTBEAT):
                    raise AssertionError(f"{frame} at {self.at}")
                await self.send(protocol.encode_nop())

    async def identify(self, **fields: object) -> dict | bytes:
        await self.send(protocol.encode_identify(fields))
        frame_type, data = await self.frame()
        assert frame_type == protocol.FRAME_TYPE_RESPONSE, data
        return json.loads(data) if fields.get("feature_negotiation") else data


class Recording(trio.abc.Stream):
    """The broker's end of a memory connection, noting every write: (time, the frames it held)."""

    def __init__(self, stream: trio.abc.Stream, writes: list[tuple[float, list[tuple[int, bytes]]]]) -> None:
        self.stream = stream
        self.writes = writes

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        parser = protocol.FrameParser()
        parser.feed(bytes(data))
        self.writes.append((trio.current_time(), list(parser)))
        # as a SocketStream's send_all: a cancelled task writes nothing (a lockstep stream would take a
        # write behind one that was cancelled half-way, and assert)
        await trio.lowlevel.checkpoint_if_cancelled()
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()


class Broker:
    """A real NSQD in the test's nursery, and connections to it by either path ("lockstep": a memory
    stream whose writes wait until the peer reads them, as a full socket buffer)."""

    def __init__(self, nsqd: NSQD, nursery: trio.Nursery) -> None:
        self.nsqd = nsqd
        self.nursery = nursery
        self.peers: list[Peer] = []

    async def connect(self, path: str = "memory") -> Peer:
        if path in ("memory", "lockstep"):
            pair = trio.testing.memory_stream_pair if path == "memory" else trio.testing.lockstep_stream_pair
            client_end, server_end = pair()
            peer = Peer(client_end)
            self.peers.append(peer)
            server = Recording(server_end, peer.writes)
            self.nursery.start_soon(self._serve, peer, self._serve_memory, server, f"mem:{len(self.peers)}")
            return peer
        a, b = socket.socketpair()
        for sock in (a, b):  # small buffers: a peer that does not read blocks the broker's writes soon
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        peer = Peer(trio.SocketStream(trio.socket.from_stdlib_socket(b)))
        self.peers.append(peer)
        server = trio.SocketStream(trio.socket.from_stdlib_socket(a))
        self.nursery.start_soon(self._serve, peer, self.nsqd._handle_tcp, server)
        await peer.send(protocol.MAGIC_V2)
        return peer

    @staticmethod
    async def _serve(peer: Peer, serve, *args: object) -> None:
        try:
            await serve(*args)
        finally:
            peer.ended_at = trio.current_time()
            peer.ended.set()

    async def _serve_memory(self, stream: trio.abc.Stream, remote: str) -> None:
        # what serve_connection does after the magic: the connection's end closes its stream (the
        # peer then reads EOF), and a write that timed out ends that connection only
        try:
            await self.nsqd._serve_v2(stream, remote)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            pass
        finally:
            await stream.aclose()

    def channel(self, topic: str, channel: str):
        return self.nsqd.topics[topic].channels[channel]

    async def publish(self, topic: str, *bodies: bytes) -> None:
        producer = await self.connect()
        await producer.send(*(protocol.encode_pub(topic, body) for body in bodies))
        assert await producer.frames(len(bodies)) == [response(protocol.OK)] * len(bodies)
        await producer.stream.aclose()

    async def consumer(self, topic: str, rdy: int, path: str = "memory", **identify: object) -> Peer:
        peer = await self.connect(path)
        if identify:
            assert await peer.identify(**identify) == protocol.OK
        await peer.send(protocol.encode_sub(topic, "c"), protocol.encode_rdy(rdy))
        assert await peer.frame() == response(protocol.OK)
        return peer


async def inline(fn, *args):
    return fn(*args)


@pytest.fixture
async def start(nursery, tmp_path):
    """start(**options) -> Broker: a real NSQD in this test's nursery, HTTP off. The clients' ends
    are closed afterwards, then the nursery is cancelled (the broker's clean exit)."""
    brokers: list[Broker] = []

    async def start(**options: object) -> Broker:
        opts = Options(tcp_address="127.0.0.1:0", http_address="", https_address="",
                       broadcast_address="127.0.0.1", data_path=str(tmp_path))
        for name, value in options.items():
            setattr(opts, name, value)
        nsqd = NSQD(opts)
        # nsqd.dat written inline: a PUB or SUB that makes its topic is answered once it is on disk, and
        # a worker thread's real time would let the mock clock jump (a heartbeat before the OK)
        nsqd.meta.run_sync = inline
        await nursery.start(nsqd.run)
        brokers.append(Broker(nsqd, nursery))
        return brokers[-1]

    yield start
    for broker in brokers:
        for peer in broker.peers:
            await peer.stream.aclose()


# --- heartbeats and the read deadline -------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
async def test_heartbeats_at_the_interval_and_nop_keeps_the_connection(start, autojump_clock, path):
    broker = await start(client_timeout=10.0)  # --heartbeat-interval is client_timeout / 2
    peer = await broker.connect(path)
    t0 = trio.current_time()
    beats = []
    for _ in range(6):  # answered: the connection outlives many read deadlines
        assert await peer.frame() == response(protocol.HEARTBEAT)
        beats.append(peer.at - t0)
        await peer.send(protocol.encode_nop())
    assert beats == [5.0, 10.0, 15.0, 20.0, 25.0, 30.0]
    await peer.send(protocol.encode_pub("still", b"here"))
    assert await peer.frame() == response(protocol.OK)


async def test_unanswered_heartbeats_close_the_connection_at_twice_the_interval(start, autojump_clock):
    """nsqd's read deadline: no command for twice the heartbeat interval. A connection read by its own
    task ends exactly then."""
    broker = await start(client_timeout=10.0)
    peer = await broker.connect()
    t0 = trio.current_time()
    frames = await peer.until_closed()
    assert peer.at - t0 == 10.0
    # the second heartbeat is due at the same instant as the deadline: either may come first
    assert frames in ([response(protocol.HEARTBEAT)], [response(protocol.HEARTBEAT)] * 2)
    assert not broker.nsqd.clients


async def test_a_parked_connection_closes_at_the_first_sweep_past_the_read_deadline(start, autojump_clock):
    """A connection waiting in the V2Poller has its read deadline checked by expire_loop, once a
    second: it is closed at the first sweep past twice the interval, no earlier."""
    broker = await start(client_timeout=10.0)
    peer = await broker.connect("socket")
    await peer.send(protocol.encode_pub("t", b"x"))  # its last read
    assert await peer.frame() == response(protocol.OK)
    t0 = trio.current_time()
    await trio.testing.wait_all_tasks_blocked()
    assert len(broker.nsqd.v2_poller.parked) == 1
    frames = await peer.until_closed()
    assert 10.0 < peer.at - t0 <= 11.0
    assert response(protocol.HEARTBEAT) in frames and set(frames) == {response(protocol.HEARTBEAT)}
    assert not broker.nsqd.v2_poller.parked and not broker.nsqd.clients


@pytest.mark.parametrize("path", PATHS)
async def test_identify_restarts_the_heartbeat_schedule_with_its_interval(start, autojump_clock, path):
    broker = await start(client_timeout=10.0)
    peer = await broker.connect(path)
    t0 = trio.current_time()
    await trio.sleep(3)
    assert await peer.identify(heartbeat_interval=1000) == protocol.OK
    frames = await peer.until_closed()
    # the next heartbeat 1 s after IDENTIFY (not at 5 s, the default schedule); the read deadline is
    # 2 s after the last read (IDENTIFY)
    assert frames[0] == response(protocol.HEARTBEAT)
    if path == "memory":
        assert peer.at - t0 == 5.0
        assert frames in ([response(protocol.HEARTBEAT)], [response(protocol.HEARTBEAT)] * 2)
    else:
        assert 5.0 < peer.at - t0 <= 6.0


async def test_identify_turns_heartbeats_off_and_then_sub_is_refused(start, autojump_clock):
    broker = await start(client_timeout=10.0)
    peer = await broker.connect()
    assert await peer.identify(heartbeat_interval=-1) == protocol.OK
    await peer.nothing_for(120, heartbeats=False)  # no heartbeats, no read deadline
    await peer.send(protocol.encode_sub("t", "c"))
    assert await peer.until_closed() == [error("E_INVALID cannot SUB with heartbeats disabled")]


# --- msg_timeout, TOUCH, FIN and REQ --------------------------------------------------------------


async def holding(start, path: str = "memory", identify: dict | None = None,
                  **options: object) -> tuple[Broker, Peer, protocol.DecodedMessage]:
    """A broker with those options, one message on topic t, and a consumer (RDY 1) holding it;
    `peer.at` is when it was delivered."""
    broker = await start(**options)
    await broker.publish("t", b"payload")
    peer = await broker.consumer("t", 1, path, **(identify or {}))
    msg = await peer.message()
    assert msg.attempts == 1
    return broker, peer, msg


def swept(broker: Broker, elapsed: float, deadline: float) -> bool:
    """A deadline is acted on by the queue scan's first pass at or after it (every queue_scan_interval)."""
    return deadline <= elapsed < deadline + broker.nsqd.options.queue_scan_interval + 1e-9


def fin_touch_req(msg_id: bytes) -> list[bytes]:
    return [protocol.encode_fin(msg_id), protocol.encode_touch(msg_id), protocol.encode_req(msg_id, 0)]


def refused(msg_id: bytes, why: str) -> list[tuple[int, bytes]]:
    """nsqd's answers to fin_touch_req: not fatal."""
    return [error(f"E_{cmd}_FAILED {cmd} {msg_id.decode()} failed {why}") for cmd in ("FIN", "TOUCH", "REQ")]


@pytest.mark.parametrize("path", PATHS)
async def test_a_message_not_finished_in_time_is_redelivered_with_attempts_plus_one(start, autojump_clock, path):
    broker, peer, first = await holding(start, path, msg_timeout=10.0)
    delivered = peer.at
    again = await peer.message()
    assert swept(broker, peer.at - delivered, 10.0)
    assert (again.id, again.body, again.timestamp, again.attempts) == (first.id, first.body, first.timestamp, 2)
    assert broker.channel("t", "c").timeout_count == 1
    await peer.send(protocol.encode_fin(again.id), protocol.encode_pub("sync", b"x"))
    assert await peer.frame() == response(protocol.OK)  # FIN raised no error before the PUB's protocol.OK
    await peer.nothing_for(100)


async def test_identify_msg_timeout_is_the_connections_timeout(start, autojump_clock):
    broker, peer, first = await holding(start, identify={"msg_timeout": 2000}, msg_timeout=60.0)
    delivered = peer.at
    again = await peer.message()
    assert swept(broker, peer.at - delivered, 2.0)
    assert (again.id, again.attempts) == (first.id, 2)


async def test_fin_of_a_message_that_timed_out_fails_and_the_connection_stays(start, autojump_clock):
    broker, peer, msg = await holding(start, msg_timeout=10.0)
    await peer.send(protocol.encode_rdy(0))  # so it is not redelivered at once
    await trio.sleep(10.0 + broker.nsqd.options.queue_scan_interval)
    await peer.send(*fin_touch_req(msg.id), protocol.encode_pub("sync", b"x"))
    assert await peer.frames(4) == [*refused(msg.id, "ID not in flight"), response(protocol.OK)]
    await peer.send(protocol.encode_rdy(1))
    again = await peer.message()  # requeued by its timeout, not lost
    assert (again.id, again.attempts) == (msg.id, 2)


@pytest.mark.parametrize("path", PATHS)
async def test_fin_touch_and_req_of_unknown_ids_are_not_fatal(start, autojump_clock, path):
    broker = await start()
    peer = await broker.consumer("t", 1, path)
    await peer.send(*fin_touch_req(UNKNOWN_ID), protocol.encode_nop(), protocol.encode_pub("t", b"after"))
    assert await peer.frames(4) == [*refused(UNKNOWN_ID, "ID not in flight"), response(protocol.OK)]
    assert (await peer.message()).body == b"after"  # still subscribed and served


async def test_fin_touch_and_req_of_another_consumers_message(start, autojump_clock):
    broker, owner, msg = await holding(start)
    other = await broker.consumer("t", 0)
    await other.send(*fin_touch_req(msg.id), protocol.encode_nop(), protocol.encode_pub("sync", b"x"))
    assert await other.frames(4) == [*refused(msg.id, "client does not own message"), response(protocol.OK)]
    await owner.send(protocol.encode_fin(msg.id), protocol.encode_pub("sync", b"x"))
    assert await owner.frame() == response(protocol.OK)  # still the owner's to finish


@pytest.mark.parametrize("path", PATHS)
async def test_touch_restarts_the_timeout(start, autojump_clock, path):
    broker, peer, msg = await holding(start, path, msg_timeout=10.0)
    delivered = peer.at
    for _ in range(5):  # a TOUCH every 8 s keeps it for 40 s, four times its timeout
        await trio.sleep(8)
        await peer.send(protocol.encode_touch(msg.id))
    await peer.nothing_for(9.9)  # 49.9 s after delivery: the last TOUCH's deadline is 50 s
    again = await peer.message()
    assert swept(broker, peer.at - delivered, 50.0)
    assert (again.id, again.attempts) == (msg.id, 2)


async def test_touch_cannot_hold_a_message_past_max_msg_timeout(start, autojump_clock):
    """nsqd caps a TOUCH's deadline at delivery + --max-msg-timeout."""
    broker, peer, msg = await holding(start, msg_timeout=10.0, max_msg_timeout=25.0)
    delivered = peer.at
    for _ in range(3):  # at 8, 16 and 24 s: the last would reach 34 s
        await trio.sleep(8)
        await peer.send(protocol.encode_touch(msg.id))
    again = await peer.message()
    assert swept(broker, peer.at - delivered, 25.0)
    assert again.attempts == 2


async def test_req_with_a_delay_redelivers_after_it(start, autojump_clock):
    broker, peer, msg = await holding(start)
    sent = trio.current_time()
    await peer.send(protocol.encode_req(msg.id, 0))
    again = await peer.message()
    assert (again.id, again.attempts, peer.at) == (msg.id, 2, sent)  # REQ 0: back at once
    requeued = peer.at
    await peer.send(protocol.encode_req(msg.id, 1500))
    third = await peer.message()
    assert swept(broker, peer.at - requeued, 1.5)
    assert (third.id, third.attempts) == (msg.id, 3)


async def test_max_defer_time_lets_dpub_wait_past_max_req_timeout_which_still_caps_req(start, autojump_clock):
    """--max-defer-time (not in nsqd, whose --max-req-timeout caps DPUB too): a DPUB waits up to it, past
    --max-req-timeout, which still caps REQ; past it a DPUB is refused with nsqd's error, its maximum in it."""
    broker = await start(max_req_timeout=1.0, max_defer_time=5.0)
    peer = await broker.consumer("t", 1)
    pub = await broker.connect()
    sent = trio.current_time()
    await pub.send(protocol.encode_dpub("t", 5000, b"later"))
    assert await pub.frames(1) == [response(protocol.OK)]
    msg = await peer.message()
    # (its deadline is kept in wall-clock seconds, and read into the channel's clock: within 10 ms)
    assert 5.0 - 0.01 <= peer.at - sent < 5.0 + broker.nsqd.options.queue_scan_interval + 0.01
    requeued = peer.at
    await peer.send(protocol.encode_req(msg.id, 5000))  # clamped to --max-req-timeout
    again = await peer.message()
    assert swept(broker, peer.at - requeued, 1.0) and again.id == msg.id
    await pub.send(protocol.encode_dpub("t", 5001, b"never"))
    assert await pub.until_closed() == [error("E_INVALID DPUB timeout 5001 out of range 0-5000")]


async def test_a_message_behind_a_long_run_of_deferred_records_comes_to_a_waiting_pump(start, autojump_clock):
    """The channel reads a long run of deferred records in turns of the event loop (here 100 records a
    turn): the consumer's pump, woken each turn, gets the message behind the run."""
    broker = await start(mem_queue_size=0)
    peer = await broker.consumer("t", 1)
    reader = broker.channel("t", "c").backend.reader
    reader.deferred_per_read = 100
    pub = await broker.connect()
    await pub.send(*(protocol.encode_dpub("t", 3_600_000, b"d%d" % i) for i in range(1000)), protocol.encode_pub("t", b"behind"))
    assert await pub.frames(1001) == [response(protocol.OK)] * 1001
    assert (await peer.message()).body == b"behind"
    assert broker.channel("t", "c").deferred_count() == 1000


# --- RDY ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
async def test_rdy_0_stops_delivery_and_rdy_again_resumes_it(start, autojump_clock, path):
    broker = await start()
    await broker.publish("t", *(b"m%d" % i for i in range(8)))
    peer = await broker.consumer("t", 2, path)
    first = await peer.messages(2)
    await peer.send(protocol.encode_rdy(0), *(protocol.encode_fin(m.id) for m in first))
    await peer.nothing_for(100)  # room for none although six wait
    assert broker.channel("t", "c").depth() == 6
    await peer.send(protocol.encode_rdy(6))
    rest = await peer.messages(6)
    assert sorted(m.body for m in first + rest) == [b"m%d" % i for i in range(8)]


@pytest.mark.parametrize("path", PATHS)
async def test_lowering_rdy_below_what_is_in_flight_holds_delivery_until_fins_make_room(start, autojump_clock, path):
    """nsqd sends only while in-flight < RDY: a RDY lowered under the messages in flight lets none
    through until FINs bring in-flight below it; raising it again sends the difference at once."""
    broker = await start()
    await broker.publish("t", *(b"m%d" % i for i in range(12)))
    peer = await broker.consumer("t", 5, path)
    msgs = await peer.messages(5)
    await peer.send(protocol.encode_rdy(2), protocol.encode_fin(msgs[0].id), protocol.encode_fin(msgs[1].id))
    await peer.nothing_for(5)  # 3 in flight, RDY 2
    await peer.send(protocol.encode_fin(msgs[2].id))
    await peer.nothing_for(5)  # 2 in flight, RDY 2
    await peer.send(protocol.encode_fin(msgs[3].id))
    msgs.append(await peer.message())  # 1 in flight: room for one
    await peer.nothing_for(5)
    client = next(iter(broker.nsqd.clients.values()))
    assert (client.ready_count, client.in_flight_count) == (2, 2)
    await peer.send(protocol.encode_rdy(6))  # room for four more, sent together
    msgs += await peer.messages(4)
    await peer.nothing_for(5)
    assert (client.ready_count, client.in_flight_count) == (6, 6)
    assert len({m.id for m in msgs}) == 10


@pytest.mark.parametrize("path", PATHS)
async def test_rdy_above_max_rdy_count_is_fatal(start, autojump_clock, path):
    broker = await start(max_rdy_count=50)
    peer = await broker.consumer("t", 50, path)  # the maximum itself is allowed
    await peer.send(protocol.encode_rdy(51), protocol.encode_pub("t", b"never"))
    assert await peer.until_closed() == [error("E_INVALID RDY count 51 out of range 0-50")]
    assert "t" not in broker.nsqd.topics or broker.nsqd.topics["t"].message_count == 0


@pytest.mark.parametrize("path", PATHS)
async def test_rdy_before_sub_is_fatal(start, autojump_clock, path):
    broker = await start()
    peer = await broker.connect(path)
    await peer.send(protocol.encode_rdy(1))
    assert await peer.until_closed() == [error("E_INVALID cannot RDY in current state")]


async def test_rdy_after_cls_is_ignored_and_nothing_more_is_sent(start, autojump_clock):
    broker = await start()
    await broker.publish("t", b"one")
    peer = await broker.consumer("t", 10)
    msg = await peer.message()
    await peer.send(protocol.encode_cls())
    assert await peer.frame() == response(protocol.CLOSE_WAIT)
    await peer.send(protocol.encode_rdy(10))  # ignored in the closing state, not refused
    await broker.publish("t", b"two")
    await peer.nothing_for(5)
    await peer.send(protocol.encode_fin(msg.id), protocol.encode_pub("sync", b"x"))
    assert await peer.frame() == response(protocol.OK)


# --- the output buffer and a consumer that does not read -------------------------------------------


@pytest.mark.parametrize("path", PATHS)
async def test_a_message_is_written_when_it_can_be_sent_not_after_output_buffer_timeout(start, autojump_clock, path):
    """Ours flushes as soon as nothing more can be sent (README, "One write per batch"); nsqd would
    hold a message for up to output_buffer_timeout while RDY has room."""
    broker = await start()
    peer = await broker.consumer("t", 10, path, output_buffer_timeout=5000, output_buffer_size=16384)
    for _ in range(3):
        await trio.sleep(1)
        published = trio.current_time()
        await broker.publish("t", b"small")
        await peer.message()
        assert peer.at == published


async def test_what_rdy_allows_at_once_goes_out_in_one_write(start, autojump_clock):
    broker = await start()
    await broker.publish("t", *(b"m%d" % i for i in range(5)))
    peer = await broker.consumer("t", 0, output_buffer_timeout=5000)
    writes = peer.writes
    before = len(writes)
    await peer.send(protocol.encode_rdy(3))
    await peer.messages(3)
    assert [len(frames) for _, frames in writes[before:]] == [3]
    await peer.send(protocol.encode_rdy(5))
    await peer.messages(2)
    assert [len(frames) for _, frames in writes[before:]] == [3, 2]


async def test_identify_output_buffer_settings_are_checked_and_answered(start, autojump_clock):
    broker = await start()
    peer = await broker.connect()
    answer = await peer.identify(feature_negotiation=True, output_buffer_size=64, output_buffer_timeout=25)
    assert (answer["output_buffer_size"], answer["output_buffer_timeout"]) == (64, 25)
    peer = await broker.connect()
    answer = await peer.identify(feature_negotiation=True, output_buffer_size=-1)
    assert (answer["output_buffer_size"], answer["output_buffer_timeout"]) == (1, 0)  # no buffer at all
    for fields, text in [
        ({"output_buffer_size": 63}, "E_BAD_BODY IDENTIFY output buffer size (63) is invalid"),
        ({"output_buffer_size": 65537}, "E_BAD_BODY IDENTIFY output buffer size (65537) is invalid"),
        ({"output_buffer_timeout": 24}, "E_BAD_BODY IDENTIFY output buffer timeout (24) is invalid"),
        ({"output_buffer_timeout": 30001}, "E_BAD_BODY IDENTIFY output buffer timeout (30001) is invalid"),
    ]:
        peer = await broker.connect()
        await peer.send(protocol.encode_identify(fields))
        assert await peer.until_closed() == [error(text)]


async def test_messages_wait_for_a_consumer_that_does_not_read_and_arrive_in_order(start, autojump_clock):
    """A write the peer does not take holds the pump (as a full socket buffer holds nsqd's); what comes
    meanwhile waits in the channel and goes out, in order, in the next write once the peer reads."""
    broker = await start(client_timeout=20.0)  # a write may wait 10 s
    peer = await broker.consumer("t", 100, "lockstep")
    writes = peer.writes
    before = len(writes)
    await broker.publish("t", b"first")
    await trio.sleep(3)
    for i in range(4):
        await broker.publish("t", b"later%d" % i)
    assert broker.channel("t", "c").depth() == 4  # not taken: the pump still waits on its write
    got = await peer.messages(5)
    assert [m.body for m in got] == [b"first", b"later0", b"later1", b"later2", b"later3"]
    assert [len(frames) for _, frames in writes[before:]] == [1, 4]


@pytest.mark.parametrize("path", ["lockstep", "socket"])
async def test_a_consumer_that_does_not_read_is_cut_off_at_the_write_deadline(start, autojump_clock, path):
    """nsqd's write deadline is the heartbeat interval: a write the peer has not taken by then ends the
    connection; its message stays in flight until msg_timeout, then goes to another consumer."""
    broker = await start(client_timeout=10.0, msg_timeout=30.0, max_msg_size=1 << 20)
    stuck = await broker.consumer("t", 10, path)
    await trio.sleep(2)
    started = trio.current_time()
    body = b"x" * 200_000  # more than the socket buffers hold
    await broker.publish("t", body)
    await stuck.ended.wait()
    assert stuck.ended_at - started == 5.0
    channel = broker.channel("t", "c")
    assert len(channel.in_flight) == 1
    other = await broker.consumer("t", 1)
    again = await other.message()
    assert (again.body, again.attempts) == (body, 2)
    assert swept(broker, other.at - started, 30.0)


# --- pipelined and split commands, errors mid-stream ----------------------------------------------


def a_session(topic: str = "p") -> tuple[bytes, list[tuple[int, bytes]]]:
    """Commands of a producer that subscribes at the end, and the answers nsqd gives them."""
    commands = [
        protocol.encode_identify({"client_id": "pipe", "heartbeat_interval": 20000}),
        protocol.encode_pub(topic, b"one"),
        protocol.encode_mpub(topic, [b"two", b"three"]),
        protocol.encode_dpub(topic, 1000, b"later"),
        protocol.encode_nop(),
        protocol.encode_pub(topic, b"four"),
        protocol.encode_sub(topic, "c"),
        protocol.encode_rdy(10),
    ]
    return b"".join(commands), [response(protocol.OK)] * 6


async def received(peer: Peer, answers: list[tuple[int, bytes]]) -> None:
    """The session's answers, then its messages: four now, the deferred one 1 s later."""
    assert await peer.frames(len(answers)) == answers
    assert sorted(m.body for m in await peer.messages(4)) == [b"four", b"one", b"three", b"two"]
    assert (await peer.message()).body == b"later"


@pytest.mark.parametrize("path", PATHS)
async def test_pipelined_commands_in_one_write(start, autojump_clock, path):
    broker = await start()
    data, answers = a_session()
    peer = await broker.connect(path)
    await peer.send(data)
    await received(peer, answers)
    # which path served it: a socket's connection waits in the poller, a memory stream's in its task
    await trio.testing.wait_all_tasks_blocked()
    assert len(broker.nsqd.v2_poller.parked) == (path == "socket")


@pytest.mark.parametrize("path", PATHS)
async def test_a_command_split_at_every_byte(start, autojump_clock, path):
    """Publishing commands in two reads, cut at each byte in turn, on one connection; then a whole
    session (IDENTIFY to SUB) one byte per read: the same answers as in one read."""
    broker = await start()
    producer = await broker.connect(path)
    data = b"".join([protocol.encode_pub("q", b"one"), protocol.encode_mpub("q", [b"two", b"three"]), protocol.encode_dpub("q", 1000, b"d"),
                     protocol.encode_nop(), protocol.encode_pub("q", b"four")])
    for cut in range(1, len(data)):
        await producer.send(data[:cut])
        await trio.testing.wait_all_tasks_blocked()  # the broker reads the first part alone
        await producer.send(data[cut:])
        assert await producer.frames(4) == [response(protocol.OK)] * 4, cut
    assert broker.nsqd.topics["q"].message_count == 5 * (len(data) - 1)
    data, answers = a_session()
    peer = await broker.connect(path)
    for i in range(len(data)):
        await peer.send(data[i : i + 1])
        await trio.testing.wait_all_tasks_blocked()
    await received(peer, answers)


@pytest.mark.parametrize("path", PATHS)
async def test_a_fatal_error_mid_stream_answers_what_came_before_and_closes(start, autojump_clock, path):
    broker = await start()
    peer = await broker.connect(path)
    await peer.send(protocol.encode_pub("e", b"1"), protocol.encode_mpub("e", [b"2", b"3"]), protocol.encode_nop(),
                    protocol.encode_sub("bad*topic", "c"), protocol.encode_pub("e", b"after"), protocol.encode_nop())
    assert await peer.until_closed() == [
        response(protocol.OK), response(protocol.OK), error('E_BAD_TOPIC SUB topic name "bad*topic" is not valid')]
    assert broker.nsqd.topics["e"].message_count == 3  # before the error: done; after it: not
    await peer.ended.wait()
    assert not broker.nsqd.clients


@pytest.mark.parametrize("path", PATHS)
async def test_a_fatal_error_in_a_body_header_mid_stream(start, autojump_clock, path):
    """A PUB's body size is refused before its body is read: the answers before it, then the error."""
    broker = await start(max_msg_size=100)
    peer = await broker.connect(path)
    await peer.send(protocol.encode_pub("e", b"ok"), protocol.encode_pub("e", b"x" * 101), protocol.encode_pub("e", b"after"))
    assert await peer.until_closed() == [response(protocol.OK), error("E_BAD_MESSAGE PUB message too big 101 > 100")]
    assert broker.nsqd.topics["e"].message_count == 1


@pytest.mark.parametrize("path", PATHS)
async def test_a_non_fatal_error_mid_stream_keeps_the_connection_and_the_commands_after_it(start, autojump_clock, path):
    broker = await start()
    await broker.publish("t", b"a", b"b")
    peer = await broker.consumer("t", 2, path)
    a, b = await peer.messages(2)
    await peer.send(protocol.encode_fin(a.id), protocol.encode_fin(UNKNOWN_ID), protocol.encode_fin(b.id), protocol.encode_fin(a.id),
                    protocol.encode_pub("t", b"c"))
    assert await peer.frames(3) == [
        refused(UNKNOWN_ID, "ID not in flight")[0],
        refused(a.id, "ID not in flight")[0],  # finished just before
        response(protocol.OK),
    ]
    assert (await peer.message()).body == b"c"
    assert len(broker.channel("t", "c").in_flight) == 1
