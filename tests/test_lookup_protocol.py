"""shared/lookup_protocol.py, the sans-IO codec of nsqlookupd's protocol V1: the commands an nsqd sends,
the responses nsqlookupd writes, both parsers under every chunking, and the broker's lookup peer speaking
it to a lookupd that reads with the codec (over trio's memory streams: no sockets).

Expected bytes are those of go-nsq's command.go (Command.WriteTo, Identify, Register, UnRegister, Ping)
as Go nsqd 1.3.0 sends them (nsqd/lookup.go, lookup_peer.go), and of nsqlookupd's replies
(internal/protocol SendResponse, nsqlookupd/lookup_protocol_v1.go).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_nsq.broker import lookup
from trio_nsq.broker.lookup import LookupPeer
from trio_nsq.lookupd import nsqlookupd
from trio_nsq.lookupd.protocol_v1 import decode_identify
from trio_nsq.shared.lookup_protocol import (
    MAGIC_V1, MAX_IDENTIFY_BODY, MAX_LINE_LENGTH, PING_CMD, ResponseParser, V1Parser, error_data, frame, identify_cmd,
    is_error, register_cmd, split_line, unregister_cmd,
)
from trio_nsq.shared.protocol import Command, FatalClientError
from trio_nsq.shared.version import VERSION

PEER = {"broadcast_address": "b1", "tcp_port": 4150, "http_port": 4151, "version": "1.3.0", "hostname": "h1"}

names = st.from_regex(r"[.a-zA-Z0-9_-]{1,54}(#ephemeral)?", fullmatch=True)


def identify_body() -> bytes:
    return json.dumps(PEER).encode()


def fatal(fn, *args) -> bytes:
    with pytest.raises(FatalClientError) as info_:
        fn(*args)
    return error_data(info_.value)


# --- nsqd's commands -------------------------------------------------------------------------------


def test_magic_is_nsqs_and_nsqlookupd_expects_the_same():
    assert MAGIC_V1 == b"  V1"
    assert nsqlookupd.MAGIC_V1 == MAGIC_V1  # lookupd/nsqlookupd.py keeps its own copy for the handshake


def test_register_unregister_and_ping_bytes():
    # Command.WriteTo: the name, " " and each param, "\n"; Register/UnRegister add the channel only if set
    assert register_cmd("t") == b"REGISTER t\n"
    assert register_cmd("t", "") == b"REGISTER t\n"
    assert register_cmd("t", "c") == b"REGISTER t c\n"
    assert register_cmd("t#ephemeral", "c#ephemeral") == b"REGISTER t#ephemeral c#ephemeral\n"
    assert unregister_cmd("t") == b"UNREGISTER t\n"
    assert unregister_cmd("t", "c") == b"UNREGISTER t c\n"
    assert PING_CMD == b"PING\n"


def test_identify_bytes():
    info = {"version": "1.3.0", "tcp_port": 4150, "http_port": 4151, "hostname": "h", "broadcast_address": "b"}
    body = b'{"version": "1.3.0", "tcp_port": 4150, "http_port": 4151, "hostname": "h", "broadcast_address": "b"}'
    assert len(body) == 100
    # the line, then the body's size as 4 big-endian bytes (WriteTo's PutUint32), then the body
    assert identify_cmd(info) == b"IDENTIFY\n\x00\x00\x00\x64" + body
    # Go's json.Marshal of the map sorts the keys and leaves out the spaces; nsqlookupd reads both the same
    go_body = b'{"broadcast_address":"b","hostname":"h","http_port":4151,"tcp_port":4150,"version":"1.3.0"}'
    assert decode_identify(body, "r:1").public() == decode_identify(go_body, "r:1").public()


# --- nsqlookupd's responses ------------------------------------------------------------------------


def test_frame_and_error_bytes():
    assert frame(b"E_BAD_TOPIC x") == b"\x00\x00\x00\x0dE_BAD_TOPIC x"
    err = FatalClientError("E_INVALID", "invalid command \udcff")  # a peer's invalid UTF-8, echoed
    assert error_data(err) == b"E_INVALID invalid command \xff"
    assert is_error(b"E_INVALID cannot IDENTIFY again") and is_error(error_data(err))
    assert not is_error(b"OK") and not is_error(b'{"tcp_port":4160}') and not is_error(b"")
    assert not is_error(b"EXAMPLE")  # the error form is "E_" and a code


def _responses() -> tuple[bytes, list[bytes]]:
    datas = [b"OK", b'{"broadcast_address":"lk","tcp_port":4160}', b"", b"E_BAD_TOPIC REGISTER topic name 'x*' is not valid",
             b"\x00\x00\x00\x05"]  # data that looks like a size is data
    return b"".join(frame(d) for d in datas), datas


def _drain_responses(parser: ResponseParser) -> list[bytes]:
    out = []
    while (data := parser.next_response()) is not None:
        out.append(data)
    return out


def test_responses_split_at_every_byte_boundary():
    stream, expected = _responses()
    for cut in range(len(stream) + 1):
        parser = ResponseParser(max_size=1024)
        parser.feed(stream[:cut])
        got = _drain_responses(parser)
        parser.feed(stream[cut:])
        got += _drain_responses(parser)
        assert got == expected, cut
        assert parser.buffered() == 0


def test_responses_one_byte_a_read_and_all_in_one_read():
    stream, expected = _responses()
    parser = ResponseParser(max_size=1024)
    got = []
    for i in range(len(stream)):
        parser.feed(stream[i : i + 1])
        got += _drain_responses(parser)
    assert got == expected
    parser.feed(stream)
    assert _drain_responses(parser) == expected
    parser.feed(frame(b"OK")[:3])
    assert parser.next_response() is None and parser.buffered() == 3


def test_response_size_bounds_and_garbage():
    parser = ResponseParser(max_size=4)
    parser.feed(frame(b"1234"))
    assert parser.next_response() == b"1234"  # at the limit
    for header in (struct.pack(">i", 5), struct.pack(">i", -1), b"HTTP/1.1 400 Bad Request\r\n"):
        parser = ResponseParser(max_size=4)
        parser.feed(header[:3])
        assert parser.next_response() is None
        parser.feed(header[3:])
        # refused as soon as the size is read, not after waiting for its bytes
        with pytest.raises(ValueError) as err:
            parser.next_response()
        (size,) = struct.unpack(">i", header[:4])
        assert str(err.value) == f"response body size ({size}) is greater than limit"


# --- V1 line splitting and the parser ------------------------------------------------------------


@pytest.mark.parametrize("line, name, params", [
    (b"PING", b"PING", ()),
    (b"PING\r", b"PING", ()),
    (b"  PING \t", b"PING", ()),                          # TrimSpace on both ends
    (b"REGISTER t c", b"REGISTER", (b"t", b"c")),
    (b"REGISTER t\t", b"REGISTER", (b"t",)),              # a trailing tab is trimmed, not a param
    (b"REGISTER  t", b"REGISTER", (b"", b"t")),           # strings.Split keeps the empty element
    (b"REGISTER t\tc", b"REGISTER", (b"t\tc",)),          # only spaces split
    (b"", b"", ()),
    (b"\xc2\xa0PING\xc2\x85", b"PING", ()),               # U+00A0 and U+0085 are Go spaces
    (b"\x1fPING", b"\x1fPING", ()),                       # \x1f is not (Python's strip would take it)
    (b"REGISTER \xff", b"REGISTER", (b"\xff",)),          # invalid UTF-8 is kept byte for byte
])
def test_split_line_is_go_trimspace_then_split(line, name, params):
    assert split_line(line) == Command(name, params)


def _stream() -> tuple[bytes, list[Command]]:
    body = identify_body()
    data = (b"PING\nIDENTIFY\n" + struct.pack(">i", len(body)) + body
            + b"REGISTER t c\r\nUNREGISTER t\n \n")
    expected = [Command(b"PING", ()), Command(b"IDENTIFY", (), body), Command(b"REGISTER", (b"t", b"c")),
                Command(b"UNREGISTER", (b"t",)), Command(b"", ())]
    return data, expected


def _drain(parser: V1Parser) -> list[Command]:
    out = []
    while (cmd := parser.next_command()) is not None:
        out.append(cmd)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=200), max_size=30))
def test_parser_gives_the_same_commands_however_the_bytes_arrive(cuts):
    data, expected = _stream()
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    parser = V1Parser()
    got = []
    for start, end in zip(points, points[1:]):
        parser.feed(data[start:end])
        got += _drain(parser)
    assert got == expected
    assert parser.buffered() == 0 and parser.eof_error() is None


def test_parser_bounds_lines_and_bodies():
    parser = V1Parser()
    parser.feed(b"P" * MAX_LINE_LENGTH)
    assert parser.next_command() is None  # at the limit: still waiting for the newline
    parser.feed(b"P")
    assert fatal(parser.next_command) == b"E_INVALID failed to read command - line too long"
    # a long line with its newline in the same chunk is refused too, without scanning past the limit
    parser = V1Parser()
    parser.feed(b"A" * (MAX_LINE_LENGTH + 10) + b"\n")
    assert fatal(parser.next_command) == b"E_INVALID failed to read command - line too long"
    for size in (MAX_IDENTIFY_BODY + 1, 2**31 - 1, -1):
        parser = V1Parser()
        parser.feed(b"IDENTIFY\n" + struct.pack(">i", size))
        assert fatal(parser.next_command) == f"E_BAD_BODY IDENTIFY invalid body size {size}".encode()
    # a zero-length body is read (and then fails to decode, as in Go)
    parser = V1Parser()
    parser.feed(b"IDENTIFY\n\x00\x00\x00\x00PING\n")
    assert _drain(parser) == [Command(b"IDENTIFY", (), b""), Command(b"PING", ())]


def test_parser_asks_before_reading_an_identify_body():
    calls = []

    def refuse():
        calls.append(1)
        raise FatalClientError("E_INVALID", "cannot IDENTIFY again")

    parser = V1Parser(on_identify=refuse)
    parser.feed(b"IDENTIFY\n")  # no size yet: Go answers a second IDENTIFY before reading one
    assert fatal(parser.next_command) == b"E_INVALID cannot IDENTIFY again"
    assert calls == [1]


def test_parser_eof_inside_identify_is_gos_read_errors():
    parser = V1Parser()
    parser.feed(b"PING")  # a partial line is dropped silently (ReadString fails)
    assert parser.next_command() is None and parser.eof_error() is None
    parser = V1Parser()
    parser.feed(b"IDENTIFY\n\x00\x00")
    assert parser.next_command() is None
    assert error_data(parser.eof_error()) == b"E_BAD_BODY IDENTIFY failed to read body size"
    parser.feed(b"\x00\x10{")
    assert parser.next_command() is None
    assert error_data(parser.eof_error()) == b"E_BAD_BODY IDENTIFY failed to read body"


def test_frame_is_size_prefixed():
    assert frame(b"OK") == b"\x00\x00\x00\x02OK"
    assert frame(b"") == b"\x00\x00\x00\x00"



# --- round trips: what the broker encodes, nsqlookupd parses -----------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["REGISTER", "UNREGISTER", "PING", "IDENTIFY"]), names,
                          st.one_of(st.just(""), names)), max_size=8))
def test_broker_commands_parse_back_on_nsqlookupd(commands):
    data = b""
    expected = []
    for kind, topic, channel in commands:
        params = (topic.encode(), channel.encode()) if channel else (topic.encode(),)
        if kind == "REGISTER":
            data += register_cmd(topic, channel)
            expected.append(Command(b"REGISTER", params))
        elif kind == "UNREGISTER":
            data += unregister_cmd(topic, channel)
            expected.append(Command(b"UNREGISTER", params))
        elif kind == "PING":
            data += PING_CMD
            expected.append(Command(b"PING", ()))
        else:
            info = {**PEER, "hostname": topic}
            data += identify_cmd(info)
            expected.append(Command(b"IDENTIFY", (), json.dumps(info).encode()))
    # every split point of the whole conversation gives the same commands
    for cut in range(len(data) + 1):
        parser = V1Parser()
        parser.feed(data[:cut])
        got = _drain(parser)
        parser.feed(data[cut:])
        got += _drain(parser)
        assert got == expected
        assert parser.buffered() == 0 and parser.eof_error() is None


def test_identify_round_trip_to_a_peer():
    parser = V1Parser()
    parser.feed(identify_cmd(PEER))
    (cmd,) = _drain(parser)
    peer = decode_identify(cmd.body, "10.0.0.1:5")
    assert (peer.broadcast_address, peer.tcp_port, peer.http_port, peer.version, peer.hostname) == (
        "b1", 4150, 4151, "1.3.0", "h1")


# --- the broker's lookup peer against a lookupd reading with the codec --------------------------------


class FakeNSQD:
    broadcast_tcp_port = 4150
    broadcast_http_port = 4151

    def __init__(self, commands: list[bytes], max_body_size: int = 5 * 1024 * 1024) -> None:
        self.options = SimpleNamespace(broadcast_address="b1", max_body_size=max_body_size)
        self._commands = commands

    def registration_commands(self) -> list[bytes]:
        return list(self._commands)


async def fake_lookupd(stream: trio.abc.Stream, answer, got: list[Command], close_after: bool = False) -> None:
    """Reads the magic and then commands with V1Parser; writes `answer(command)` a byte at a time, each
    byte left to be read before the next is sent, so the broker gets every response in pieces; with
    close_after, closes once the first answer is written."""
    magic = b""
    while len(magic) < 4:
        magic += await stream.receive_some(4 - len(magic))
    assert magic == MAGIC_V1
    parser = V1Parser()
    while data := await stream.receive_some(65536):
        parser.feed(data)
        while (cmd := parser.next_command()) is not None:
            got.append(cmd)
            response = answer(cmd)
            for i in range(len(response)):
                await stream.send_all(response[i : i + 1])
                await trio.testing.wait_all_tasks_blocked()
            if close_after:
                await stream.aclose()
                return


def answer_ok(cmd: Command) -> bytes:
    if cmd.name == b"IDENTIFY":
        return frame(b'{"broadcast_address":"lk","http_port":4161,"tcp_port":4160,"version":"1.3.0"}')
    return frame(b"OK")


async def wait_for_commands(got: list[Command], n: int) -> None:
    with trio.fail_after(5):
        while len(got) < n:
            await trio.sleep(0.001)


def connect_to(monkeypatch, stream: trio.abc.Stream) -> None:
    async def open_tcp_stream(host: str, port: int) -> trio.abc.Stream:
        assert (host, port) == ("127.0.0.1", 4160)
        return stream

    monkeypatch.setattr(trio, "open_tcp_stream", open_tcp_stream)


async def test_broker_peer_identifies_registers_notifies_and_pings(monkeypatch):
    broker_end, lookupd_end = trio.testing.memory_stream_pair()
    connect_to(monkeypatch, broker_end)
    monkeypatch.setattr(lookup, "PING_INTERVAL", 0.05)
    peer = LookupPeer(FakeNSQD([register_cmd("t"), register_cmd("t2", "c")]), "127.0.0.1:4160")
    got: list[Command] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake_lookupd, lookupd_end, answer_ok, got)
        nursery.start_soon(peer._session)
        await wait_for_commands(got, 3)
        identify, registers = got[0], got[1:3]
        assert (identify.name, identify.params) == (b"IDENTIFY", ())
        assert json.loads(identify.body) == {"version": VERSION, "tcp_port": 4150, "http_port": 4151,
                                             "hostname": socket.gethostname(), "broadcast_address": "b1"}
        assert registers == [Command(b"REGISTER", (b"t",)), Command(b"REGISTER", (b"t2", b"c"))]
        assert peer.connected and peer.info["tcp_port"] == 4160
        assert peer.info["broadcast_address"] == "lk"
        peer.notify(unregister_cmd("t2", "c"))
        await wait_for_commands(got, 5)
        nursery.cancel_scope.cancel()
    rest = got[3:]
    assert Command(b"UNREGISTER", (b"t2", b"c")) in rest
    assert Command(b"PING", ()) in rest
    assert set(rest) <= {Command(b"UNREGISTER", (b"t2", b"c")), Command(b"PING", ())}


async def test_broker_peer_logs_an_error_response_and_goes_on(monkeypatch, caplog):
    broker_end, lookupd_end = trio.testing.memory_stream_pair()
    connect_to(monkeypatch, broker_end)

    def answer(cmd: Command) -> bytes:
        if cmd.params[:1] == (b"bad",):
            return frame(b"E_BAD_TOPIC REGISTER topic name 'bad' is not valid")
        return answer_ok(cmd)

    peer = LookupPeer(FakeNSQD([register_cmd("bad"), register_cmd("t")]), "127.0.0.1:4160")
    got: list[Command] = []
    with caplog.at_level(logging.ERROR, logger="nsqd"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake_lookupd, lookupd_end, answer, got)
            nursery.start_soon(peer._session)
            await wait_for_commands(got, 3)
            await trio.testing.wait_all_tasks_blocked()
            assert peer.connected  # the session goes on after the refused REGISTER
            nursery.cancel_scope.cancel()
    assert got[1:] == [Command(b"REGISTER", (b"bad",)), Command(b"REGISTER", (b"t",))]
    assert ("LOOKUPD(127.0.0.1:4160): REGISTER bad - E_BAD_TOPIC REGISTER topic name 'bad' is not valid"
            in caplog.messages)


@pytest.mark.parametrize("response, close_after, error, text", [
    (b"HTTP/1.1 400 Bad Request\r\n", False, ValueError, "response body size (1213486160) is greater than limit"),
    (frame(b"x" * 101), False, ValueError, "response body size (101) is greater than limit"),
    (frame(b"x" * 10)[:6], True, trio.BrokenResourceError, "lookupd closed the connection"),  # inside a response
    (b"", True, trio.BrokenResourceError, "lookupd closed the connection"),
])
async def test_broker_peer_refuses_a_bad_identify_response(monkeypatch, response, close_after, error, text):
    broker_end, lookupd_end = trio.testing.memory_stream_pair()
    connect_to(monkeypatch, broker_end)
    peer = LookupPeer(FakeNSQD([], max_body_size=100), "127.0.0.1:4160")
    got: list[Command] = []

    def answer(cmd: Command) -> bytes:
        return response

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake_lookupd, lookupd_end, answer, got, close_after)
        with pytest.raises(error) as err:
            await peer._session()
        nursery.cancel_scope.cancel()
    assert str(err.value) == text
    assert [cmd.name for cmd in got] == [b"IDENTIFY"] and not peer.connected
