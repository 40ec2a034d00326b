"""Producers' connections served in place between commands (broker/v2_poller.py), in-process: a
real NSQD in this test's nursery and raw V2 over loopback sockets, so that exactly which connection is
parked, and what each read did, can be looked at. What a client sees must not change: pipelined
commands, commands split across reads, a peer that does not read its answers, errors mid-stream, the
read deadline, a producer that subscribes."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from trio_nsq import run_nsqd
from trio_nsq.shared.protocol import FRAME_TYPE_ERROR, FRAME_TYPE_MESSAGE, FRAME_TYPE_RESPONSE, MAGIC_V2

OK_FRAME = struct.pack(">ii", 6, FRAME_TYPE_RESPONSE) + b"OK"


def pub(topic: bytes, body: bytes) -> bytes:
    return b"PUB " + topic + b"\n" + struct.pack(">i", len(body)) + body


class Peer:
    """A raw V2 connection: sends bytes, reads frames."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    @classmethod
    async def connect(cls, address: str, *, rcvbuf: int = 0) -> Peer:
        host, port = address.rsplit(":", 1)
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await sock.connect((host, int(port)))
        peer = cls(trio.SocketStream(sock))
        await peer.send(MAGIC_V2)
        return peer

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def frame(self) -> tuple[int, bytes]:
        while True:
            if len(self.buf) >= 4:
                (size,) = struct.unpack_from(">i", self.buf)
                if len(self.buf) >= 4 + size:
                    frame_type = struct.unpack_from(">i", self.buf, 4)[0]
                    data = bytes(self.buf[8 : 4 + size])
                    del self.buf[: 4 + size]
                    return frame_type, data
            data = await self.stream.receive_some(65536)
            if not data:
                raise EOFError("connection closed")
            self.buf += data

    async def answers(self, n: int) -> list[tuple[int, bytes]]:
        return [await self.frame() for _ in range(n)]

    async def closed(self) -> bool:
        """True once the broker closed the connection (what it sent before is read and dropped)."""
        try:
            while await self.stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        return True


def topic_count(nsqd, topic: str) -> int:
    return nsqd.server.topics[topic].message_count


@pytest.fixture
async def nsqd(nursery):
    yield await nursery.start(run_nsqd)


async def test_pipelined_pubs_are_answered_in_place_and_the_connection_stays_parked(nsqd):
    poller = nsqd.server.v2_poller
    peer = await Peer.connect(nsqd.tcp_address)
    await peer.send(b"".join(pub(b"t", b"m%d" % i) for i in range(500)))
    assert await peer.answers(500) == [(FRAME_TYPE_RESPONSE, b"OK")] * 500
    assert topic_count(nsqd, "t") == 500
    # between commands the connection waits in the poller, not in a read of its own
    await trio.testing.wait_all_tasks_blocked()
    assert len(poller.parked) == 1
    # served in place: the next round trips do not take it out
    for i in range(20):
        await peer.send(pub(b"t", b"x"))
        assert await peer.frame() == (FRAME_TYPE_RESPONSE, b"OK")
    assert topic_count(nsqd, "t") == 520
    assert len(poller.parked) == 1


async def test_a_command_split_across_reads(nsqd):
    peer = await Peer.connect(nsqd.tcp_address)
    data = pub(b"split", b"hello world") + b"NOP\n" + pub(b"split", b"second")
    for i in range(len(data)):  # a byte per read
        await peer.send(data[i : i + 1])
        await trio.testing.wait_all_tasks_blocked()
    assert await peer.answers(2) == [(FRAME_TYPE_RESPONSE, b"OK")] * 2
    topic = nsqd.server.topics["split"]
    assert topic.message_count == 2


async def test_a_peer_that_does_not_read_gets_every_answer_later(nsqd):
    """Answers the socket does not take go to the connection's task, which writes them as the peer
    reads; every PUB sent is published once and answered OK once, in order."""
    poller = nsqd.server.v2_poller
    peer = await Peer.connect(nsqd.tcp_address, rcvbuf=4096)
    count = 60_000  # 600 kB of answers: more than both socket buffers hold
    batch = b"".join(pub(b"slow", b"x") for _ in range(1000))

    async def send() -> None:
        for _ in range(count // 1000):
            await peer.send(batch)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        # the broker's answers fill both socket buffers, it stops reading (as nsqd does), the sender
        # stops: everything waits for this peer to read
        await trio.testing.wait_all_tasks_blocked()
        assert len(poller.parked) == 0  # its answers are waiting to be written: its task has it
        got = await peer.answers(count)
    assert got == [(FRAME_TYPE_RESPONSE, b"OK")] * count
    assert topic_count(nsqd, "slow") == count
    await trio.testing.wait_all_tasks_blocked()
    assert len(poller.parked) == 1  # back in the poller once everything is written


async def test_an_error_mid_stream_ends_that_connection_only_after_the_answers_before_it(nsqd):
    peer = await Peer.connect(nsqd.tcp_address)
    other = await Peer.connect(nsqd.tcp_address)
    await peer.send(pub(b"e", b"1") + pub(b"e", b"2") + pub(b"bad*topic", b"3") + pub(b"e", b"4"))
    assert await peer.answers(3) == [(FRAME_TYPE_RESPONSE, b"OK")] * 2 + [
        (FRAME_TYPE_ERROR, b'E_BAD_TOPIC PUB topic name "bad*topic" is not valid')]
    assert await peer.closed()
    assert topic_count(nsqd, "e") == 2  # what came after the error was not published
    # a bad body size ends the other connection the same way; a new one is served as before
    await other.send(pub(b"e", b"5"))
    assert await other.frame() == (FRAME_TYPE_RESPONSE, b"OK")
    await other.send(b"PUB e\n" + struct.pack(">i", 0))
    assert await other.frame() == (FRAME_TYPE_ERROR, b"E_BAD_MESSAGE PUB invalid message body size 0")
    assert await other.closed()
    fresh = await Peer.connect(nsqd.tcp_address)
    await fresh.send(pub(b"e", b"6"))
    assert await fresh.frame() == (FRAME_TYPE_RESPONSE, b"OK")
    assert topic_count(nsqd, "e") == 4


async def test_identify_then_publish_then_subscribe(nsqd):
    """IDENTIFY awaits (its task answers), PUBs are served in place, and after SUB the connection is
    still served in place while its pump delivers what the topic held and what comes later."""
    poller = nsqd.server.v2_poller
    peer = await Peer.connect(nsqd.tcp_address)
    identify = b'{"feature_negotiation": true, "heartbeat_interval": 5000}'
    await peer.send(b"IDENTIFY\n" + struct.pack(">i", len(identify)) + identify + pub(b"s", b"a") + pub(b"s", b"b"))
    frame_type, data = await peer.frame()
    assert frame_type == FRAME_TYPE_RESPONSE and b'"max_rdy_count"' in data
    assert await peer.answers(2) == [(FRAME_TYPE_RESPONSE, b"OK")] * 2
    await trio.testing.wait_all_tasks_blocked()
    assert len(poller.parked) == 1
    await peer.send(b"SUB s c\nRDY 10\n")
    assert await peer.frame() == (FRAME_TYPE_RESPONSE, b"OK")
    # the channel made by SUB gets what the topic held (a, b), then what is published later
    got = [await peer.frame(), await peer.frame()]
    assert sorted(f[1][26:] for f in got) == [b"a", b"b"] and {f[0] for f in got} == {FRAME_TYPE_MESSAGE}
    await trio.testing.wait_all_tasks_blocked()
    assert len(poller.parked) == 1
    await peer.send(pub(b"s", b"c"))
    frames = await peer.answers(2)  # its OK and the message, in either order
    assert sorted(f[0] for f in frames) == [FRAME_TYPE_RESPONSE, FRAME_TYPE_MESSAGE]
    assert (FRAME_TYPE_RESPONSE, b"OK") in frames
    assert [f[1][26:] for f in frames if f[0] == FRAME_TYPE_MESSAGE] == [b"c"]


async def test_a_consumer_with_rdy_1_gets_each_next_message_for_its_fin(nsqd):
    """RDY 1, a FIN each (go-nsq's max-in-flight 1): every FIN read in place sends the next message
    from there; nothing is delivered twice or lost, in publish order, and the connection stays parked."""
    poller = nsqd.server.v2_poller
    producer = await Peer.connect(nsqd.tcp_address)
    await producer.send(b"".join(pub(b"r", b"%04d" % i) for i in range(300)))
    assert await producer.answers(300) == [(FRAME_TYPE_RESPONSE, b"OK")] * 300
    consumer = await Peer.connect(nsqd.tcp_address)
    await consumer.send(b"SUB r c\nRDY 1\n")
    assert await consumer.frame() == (FRAME_TYPE_RESPONSE, b"OK")
    got = []
    for _ in range(300):
        frame_type, data = await consumer.frame()
        assert frame_type == FRAME_TYPE_MESSAGE
        got.append(data[26:])
        channel = nsqd.server.topics["r"].channels["c"]
        assert len(channel.in_flight) == 1  # RDY 1: one at a time
        await consumer.send(b"FIN " + data[10:26] + b"\n")
    assert got == [b"%04d" % i for i in range(300)]
    await trio.testing.wait_all_tasks_blocked()
    assert len(channel.in_flight) == 0 and channel.depth() == 0
    assert len(poller.parked) == 2
    # with room and an empty channel, the pump waits for what comes next
    await producer.send(pub(b"r", b"later"))
    assert await producer.frame() == (FRAME_TYPE_RESPONSE, b"OK")
    frame_type, data = await consumer.frame()
    assert (frame_type, data[26:]) == (FRAME_TYPE_MESSAGE, b"later")


def test_the_read_deadline_of_a_parked_connection():
    """nsqd closes a connection that sends nothing for twice its heartbeat interval: a parked one too
    (MockClock: exact time)."""
    clock = trio.testing.MockClock(autojump_threshold=0.1)

    async def main():
        async with trio.open_nursery() as nursery:
            nsqd = await nursery.start(run_nsqd)
            poller = nsqd.server.v2_poller
            peer = await Peer.connect(nsqd.tcp_address)
            identify = b'{"heartbeat_interval": 1000}'
            await peer.send(b"IDENTIFY\n" + struct.pack(">i", len(identify)) + identify + pub(b"d", b"a"))
            assert await peer.answers(2) == [(FRAME_TYPE_RESPONSE, b"OK")] * 2
            start = trio.current_time()
            while True:  # heartbeats, not answered, until the broker gives up
                try:
                    frame = await peer.frame()
                except (EOFError, trio.BrokenResourceError):
                    break
                assert frame == (FRAME_TYPE_RESPONSE, b"_heartbeat_")
            waited = trio.current_time() - start
            assert 2.0 <= waited <= 3.5  # 2 x 1 s, found by the once-a-second sweep
            assert not poller.parked
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
