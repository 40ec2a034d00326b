"""shared/protocol.py, the sans-IO V2 codec: round trips under every chunking, and nsqd's exact errors.

Expected codes and texts are those of nsqd/protocol_v2.go (readMPUB, IDENTIFY) and
internal/protocol/byte_base10.go; the line limit is that of the 16 KiB bufio.Reader nsqd reads
commands with (client_v2.go defaultBufferSize).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_nsq.shared.protocol import (
    BODY_COMMANDS,
    FRAME_TYPE_ERROR,
    FRAME_TYPE_MESSAGE,
    FRAME_TYPE_RESPONSE,
    HEARTBEAT,
    MIN_VALID_MSG_LENGTH,
    ClientError,
    Command,
    CommandParser,
    DecodedMessage,
    FatalClientError,
    FrameParser,
    IdentifyData,
    decode_message,
    encode_auth,
    encode_cls,
    encode_dpub,
    encode_fin,
    encode_frame,
    encode_identify,
    encode_message,
    encode_message_frame,
    encode_mpub,
    encode_mpub_body,
    encode_nop,
    encode_pub,
    encode_rdy,
    encode_req,
    encode_sub,
    encode_touch,
    parse_int,
    parse_mpub_body,
)

# --- strategies -------------------------------------------------------------------------------------

names = st.from_regex(r"[.a-zA-Z0-9_-]{1,54}(#ephemeral)?", fullmatch=True)
# bodies hold every byte value, newlines and spaces included: a body must never be split as a line
bodies = st.binary(min_size=0, max_size=200)
nonempty_bodies = st.binary(min_size=1, max_size=200)
msg_ids = st.binary(min_size=8, max_size=8).map(lambda b: b.hex().encode())
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**31), 2**31), st.text(max_size=20))


@st.composite
def commands(draw) -> tuple[bytes, Command]:
    """One client command as the encode_* helpers write it, with the Command the parser must return."""
    kind = draw(
        st.sampled_from(
            ["identify", "auth", "sub", "pub", "mpub", "dpub", "rdy", "fin", "req", "touch", "cls", "nop"]
        )
    )
    topic = draw(names)
    t = topic.encode()
    if kind == "identify":
        data = draw(st.dictionaries(st.text(max_size=12), json_scalars, max_size=6))
        return encode_identify(data), Command(b"IDENTIFY", (), json.dumps(data).encode())
    if kind == "auth":
        secret = draw(bodies)
        return encode_auth(secret), Command(b"AUTH", (), secret)
    if kind == "sub":
        channel = draw(names)
        return encode_sub(topic, channel), Command(b"SUB", (t, channel.encode()))
    if kind == "pub":
        body = draw(bodies)
        return encode_pub(topic, body), Command(b"PUB", (t,), body)
    if kind == "mpub":
        msgs = draw(st.lists(nonempty_bodies, min_size=1, max_size=6))
        return encode_mpub(topic, msgs), Command(b"MPUB", (t,), encode_mpub_body(msgs))
    if kind == "dpub":
        delay, body = draw(st.integers(0, 3_600_000)), draw(bodies)
        return encode_dpub(topic, delay, body), Command(b"DPUB", (t, b"%d" % delay), body)
    if kind == "rdy":
        n = draw(st.integers(0, 10**9))
        return encode_rdy(n), Command(b"RDY", (b"%d" % n,))
    if kind == "fin":
        msg_id = draw(msg_ids)
        return encode_fin(msg_id), Command(b"FIN", (msg_id,))
    if kind == "touch":
        msg_id = draw(msg_ids)
        return encode_touch(msg_id), Command(b"TOUCH", (msg_id,))
    if kind == "req":
        msg_id, delay = draw(msg_ids), draw(st.integers(0, 3_600_000))
        return encode_req(msg_id, delay), Command(b"REQ", (msg_id, b"%d" % delay))
    if kind == "cls":
        return encode_cls(), Command(b"CLS", ())
    return encode_nop(), Command(b"NOP", ())


def _accept_all(name, params, size):
    return None


def _parse_in_chunks(wire: bytes, cuts: list[int], parser: CommandParser | None = None) -> list[Command]:
    parser = parser or CommandParser(_accept_all)
    got: list[Command] = []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(wire))), len(wire)]
    for start, end in zip(bounds, bounds[1:]):
        parser.feed(wire[start:end])
        while (cmd := parser.next_command()) is not None:
            got.append(cmd)
    assert parser.buffered() == 0
    assert parser.wanted() == 0
    return got


def _fatal(exc_info) -> tuple[str, str]:
    err = exc_info.value
    assert isinstance(err, FatalClientError) and err.fatal
    return err.code, err.description


# --- commands: round trips ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(commands(), min_size=1, max_size=8), st.data())
def test_commands_round_trip_under_random_chunking(cmds, data):
    wire = b"".join(w for w, _ in cmds)
    cuts = data.draw(st.lists(st.integers(1, max(1, len(wire) - 1)), max_size=30))
    assert _parse_in_chunks(wire, cuts) == [c for _, c in cmds]


@settings(max_examples=60, deadline=None)
@given(st.lists(commands(), min_size=1, max_size=5))
def test_commands_round_trip_fed_one_byte_at_a_time(cmds):
    wire = b"".join(w for w, _ in cmds)
    assert _parse_in_chunks(wire, list(range(len(wire)))) == [c for _, c in cmds]


@settings(max_examples=60, deadline=None)
@given(st.lists(commands(), min_size=1, max_size=8))
def test_commands_round_trip_fed_all_at_once(cmds):
    wire = b"".join(w for w, _ in cmds)
    assert _parse_in_chunks(wire, []) == [c for _, c in cmds]


# any line without a body command name: split on single spaces exactly as nsqd's bytes.Split
_line_words = st.binary(max_size=12).filter(lambda b: not (set(b) & {ord("\n"), ord("\r"), ord(" ")}))


@settings(max_examples=200, deadline=None)
@given(st.lists(_line_words, min_size=1, max_size=5), st.booleans())
def test_arbitrary_lines_split_on_single_spaces(words, crlf):
    if words[0] in BODY_COMMANDS:
        words[0] = b"X" + words[0]
    line = b" ".join(words)
    parser = CommandParser(_accept_all)
    parser.feed(line + (b"\r\n" if crlf else b"\n"))
    assert parser.next_command() == Command(words[0], tuple(words[1:]))
    assert parser.next_command() is None


def test_empty_line_and_double_spaces_as_nsqd_splits_them():
    # nsqd: bytes.Split(line, " ") -> an empty line is the command "", "SUB a  b" has an empty param
    parser = CommandParser(_accept_all)
    parser.feed(b"\nSUB a  b\nRDY \n")
    assert parser.next_command() == Command(b"", ())
    assert parser.next_command() == Command(b"SUB", (b"a", b"", b"b"))
    assert parser.next_command() == Command(b"RDY", (b"",))
    assert parser.next_command() is None


def test_crlf_is_trimmed_only_once():
    parser = CommandParser(_accept_all)
    parser.feed(b"NOP\r\nFIN abc\r\r\n")
    assert parser.next_command() == Command(b"NOP", ())
    assert parser.next_command() == Command(b"FIN", (b"abc\r",))


def test_body_containing_newlines_is_not_a_line():
    body = b"\nNOP\n\r\n SUB x y\n"
    parser = CommandParser(_accept_all)
    parser.feed(encode_pub("t", body) + encode_nop())
    assert parser.next_command() == Command(b"PUB", (b"t",), body)
    assert parser.next_command() == Command(b"NOP", ())


def test_wanted_reports_what_the_pending_body_still_needs():
    parser = CommandParser(_accept_all)
    wire = encode_pub("t", b"x" * 100)
    parser.feed(wire[:6])  # the line, no size yet
    assert parser.next_command() is None and parser.wanted() == 0
    parser.feed(wire[6:10])  # the size
    assert parser.next_command() is None and parser.wanted() == 100
    parser.feed(wire[10:40])
    assert parser.next_command() is None and parser.wanted() == 70
    parser.feed(wire[40:])
    assert parser.next_command() == Command(b"PUB", (b"t",), b"x" * 100)
    assert parser.wanted() == 0


def test_take_buffered_returns_the_bytes_after_the_last_command():
    # what follows IDENTIFY when TLS/snappy/deflate is negotiated belongs to the upgraded stream
    parser = CommandParser(_accept_all)
    parser.feed(encode_identify({"tls_v1": True}) + b"\x16\x03\x01rest")
    assert parser.next_command().name == b"IDENTIFY"
    assert parser.take_buffered() == b"\x16\x03\x01rest"
    assert parser.buffered() == 0
    parser.feed(encode_nop())
    assert parser.next_command() == Command(b"NOP", ())


# --- commands: the body size check ------------------------------------------------------------------


def _body_command(name: bytes) -> tuple[bytes, tuple[bytes, ...]]:
    line, params = {
        b"IDENTIFY": (b"IDENTIFY\n", ()),
        b"AUTH": (b"AUTH\n", ()),
        b"PUB": (b"PUB t\n", (b"t",)),
        b"MPUB": (b"MPUB t\n", (b"t",)),
        b"DPUB": (b"DPUB t 1000\n", (b"t", b"1000")),
    }[name]
    return line, params


@pytest.mark.parametrize("name", sorted(BODY_COMMANDS))
def test_size_check_raises_before_a_single_body_byte_arrives(name):
    calls = []

    def check(cmd_name, params, size):
        calls.append((cmd_name, params, size))
        if size is not None and size > 10:
            raise FatalClientError("E_BAD_BODY", f"{cmd_name.decode()} body too big {size} > 10")

    line, params = _body_command(name)
    parser = CommandParser(check)
    parser.feed(line)
    assert parser.next_command() is None
    assert calls == [(name, params, None)]  # the params are checked as soon as the line is read
    parser.feed((1 << 30).to_bytes(4, "big"))  # the header only: a 1 GiB body is announced, none sent
    with pytest.raises(FatalClientError) as err:
        parser.next_command()
    assert _fatal(err) == ("E_BAD_BODY", f"{name.decode()} body too big {1 << 30} > 10")
    assert calls == [(name, params, None), (name, params, 1 << 30)]
    assert parser.buffered() == 0  # nothing of the body was there, nothing was waited for


def test_size_check_sees_the_size_split_over_several_feeds():
    calls = []
    parser = CommandParser(lambda n, p, s: calls.append(s))
    parser.feed(b"PUB t\n\x00")
    assert parser.next_command() is None and calls == [None]
    parser.feed(b"\x00\x01")
    assert parser.next_command() is None and calls == [None]
    parser.feed(b"\x00")
    assert parser.next_command() is None and calls == [None, 256]
    parser.feed(b"b" * 256)
    assert parser.next_command() == Command(b"PUB", (b"t",), b"b" * 256)
    assert calls == [None, 256]  # once each, never again while the body arrives


def test_a_refused_line_is_refused_before_the_size_is_read():
    def check(name, params, size):
        if size is None and not params:
            raise FatalClientError("E_INVALID", "PUB insufficient number of parameters")

    parser = CommandParser(check)
    parser.feed(b"PUB\n")
    with pytest.raises(FatalClientError) as err:
        parser.next_command()
    assert _fatal(err) == ("E_INVALID", "PUB insufficient number of parameters")


def test_size_is_read_as_a_signed_int32_as_nsqd_readLen_does():
    seen = []

    def check(name, params, size):
        seen.append(size)
        if size is not None and size <= 0:
            raise FatalClientError("E_BAD_MESSAGE", f"PUB invalid message body size {size}")

    parser = CommandParser(check)
    parser.feed(b"PUB t\n\xff\xff\xff\xff")
    with pytest.raises(FatalClientError) as err:
        parser.next_command()
    assert _fatal(err) == ("E_BAD_MESSAGE", "PUB invalid message body size -1")
    assert seen == [None, -1]


def test_commands_without_a_body_never_call_the_check():
    calls = []
    parser = CommandParser(lambda *a: calls.append(a))
    parser.feed(encode_sub("t", "c") + encode_rdy(1) + encode_fin(b"0" * 16) + encode_nop() + encode_cls())
    while parser.next_command() is not None:
        pass
    assert calls == []


# --- commands: line too long ------------------------------------------------------------------------

LINE_TOO_LONG = ("E_INVALID", "failed to read command - line too long")


def test_line_too_long_without_a_newline_is_fatal_before_it_ends():
    parser = CommandParser(_accept_all)
    parser.feed(b"SUB " + b"a" * 20_000)  # no newline yet: must not buffer forever
    with pytest.raises(FatalClientError) as err:
        parser.next_command()
    assert _fatal(err) == LINE_TOO_LONG


def test_line_too_long_with_its_newline_is_fatal():
    parser = CommandParser(_accept_all)
    parser.feed(b"SUB " + b"a" * 20_000 + b" c\nNOP\n")
    with pytest.raises(FatalClientError) as err:
        parser.next_command()
    assert _fatal(err) == LINE_TOO_LONG


def test_line_too_long_fed_one_kilobyte_at_a_time():
    parser = CommandParser(_accept_all, max_line_length=4096)
    with pytest.raises(FatalClientError) as err:
        for _ in range(10):
            parser.feed(b"x" * 1024)
            assert parser.next_command() is None
    assert _fatal(err) == LINE_TOO_LONG
    assert parser.buffered() <= 4096 + 1024  # refused as soon as it passed the limit


def test_long_line_after_earlier_commands_is_measured_from_its_own_start():
    parser = CommandParser(_accept_all, max_line_length=100)
    parser.feed(b"NOP\n" * 50 + b"FIN " + b"a" * 90 + b"\n")
    got = []
    while (cmd := parser.next_command()) is not None:
        got.append(cmd)
    assert got[-1] == Command(b"FIN", (b"a" * 90,)) and len(got) == 51


def test_line_length_boundary_matches_nsqd_bufio():
    """nsqd reads a line with bufio.Reader.ReadSlice('\\n') over a 16 KiB buffer: the line *with* its
    newline must fit in 16384 bytes, so a 16383-byte line is read and a 16384-byte line fails."""
    ok = CommandParser(_accept_all)
    ok.feed(b"a" * 16383 + b"\n")
    assert ok.next_command() == Command(b"a" * 16383, ())

    too_long = CommandParser(_accept_all)
    too_long.feed(b"a" * 16384 + b"\n")
    with pytest.raises(FatalClientError) as err:
        too_long.next_command()
    assert _fatal(err) == LINE_TOO_LONG


# --- MPUB body --------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(nonempty_bodies, min_size=1, max_size=40))
def test_mpub_body_round_trip_at_the_tightest_limits(msgs):
    body = encode_mpub_body(msgs)
    # the smallest limits that still accept it: the largest message, and the body itself
    assert parse_mpub_body(body, max(map(len, msgs)), len(body)) == msgs
    assert parse_mpub_body(body, 1 << 20, 5 << 20) == msgs


@settings(max_examples=100, deadline=None)
@given(st.lists(nonempty_bodies, min_size=1, max_size=10))
def test_mpub_command_round_trip_through_the_parser(msgs):
    parser = CommandParser(_accept_all)
    parser.feed(encode_mpub("t", msgs))
    cmd = parser.next_command()
    assert cmd.name == b"MPUB" and cmd.params == (b"t",)
    assert parse_mpub_body(cmd.body, 1 << 20, 5 << 20) == msgs


def _i32(n: int) -> bytes:
    return n.to_bytes(4, "big", signed=True)


MAX_MSG, MAX_BODY = 100, 1004  # (1004 - 4) // 5 == 200 messages at most


@pytest.mark.parametrize(
    "body, code, text",
    [
        (b"", "E_BAD_BODY", "MPUB failed to read message count"),
        (b"\x00\x00\x01", "E_BAD_BODY", "MPUB failed to read message count"),
        (_i32(0), "E_BAD_BODY", "MPUB invalid message count 0"),
        (_i32(-1), "E_BAD_BODY", "MPUB invalid message count -1"),
        (_i32(-(2**31)), "E_BAD_BODY", f"MPUB invalid message count {-(2**31)}"),
        (_i32(201), "E_BAD_BODY", "MPUB invalid message count 201"),
        (_i32(2**31 - 1), "E_BAD_BODY", f"MPUB invalid message count {2**31 - 1}"),
        # 200 passes the count check; the sizes then run out
        (_i32(200), "E_BAD_MESSAGE", "MPUB failed to read message(0) body size"),
        (_i32(1) + _i32(0), "E_BAD_MESSAGE", "MPUB invalid message(0) body size 0"),
        (_i32(2) + _i32(1) + b"x" + _i32(-7), "E_BAD_MESSAGE", "MPUB invalid message(1) body size -7"),
        (_i32(1) + _i32(101) + b"x" * 101, "E_BAD_MESSAGE", "MPUB message too big 101 > 100"),
        (_i32(2) + _i32(1) + b"x" + _i32(2**31 - 1), "E_BAD_MESSAGE", f"MPUB message too big {2**31 - 1} > 100"),
        (_i32(2) + _i32(1) + b"x", "E_BAD_MESSAGE", "MPUB failed to read message(1) body size"),
        (_i32(3) + _i32(1) + b"x" + _i32(1) + b"y" + b"\x00\x00", "E_BAD_MESSAGE", "MPUB failed to read message(2) body size"),
        (_i32(1) + _i32(5) + b"xx", "E_BAD_MESSAGE", "MPUB failed to read message body"),
        (_i32(2) + _i32(1) + b"x" + _i32(3), "E_BAD_MESSAGE", "MPUB failed to read message body"),
    ],
)
def test_mpub_errors_are_nsqds(body, code, text):
    with pytest.raises(FatalClientError) as err:
        parse_mpub_body(body, MAX_MSG, MAX_BODY)
    assert _fatal(err) == (code, text)
    assert err.value.frame_data() == f"{code} {text}".encode()


def test_mpub_message_of_exactly_max_msg_size_is_accepted():
    assert parse_mpub_body(_i32(1) + _i32(100) + b"m" * 100, MAX_MSG, MAX_BODY) == [b"m" * 100]


def test_mpub_count_limit_follows_max_body_size():
    # nsqd: maxMessages = (maxBodySize - 4) / 5 (4 for the count, 5 for a size and one byte)
    msgs = [b"x"] * 200
    assert parse_mpub_body(encode_mpub_body(msgs), MAX_MSG, MAX_BODY) == msgs
    with pytest.raises(FatalClientError) as err:
        parse_mpub_body(encode_mpub_body(msgs), MAX_MSG, MAX_BODY - 1)
    assert _fatal(err) == ("E_BAD_BODY", "MPUB invalid message count 200")


def test_mpub_first_error_wins_in_nsqds_order():
    # message 0 is fine, message 1 is too big and also truncated: the size check comes first
    body = _i32(3) + _i32(1) + b"x" + _i32(500) + b"short"
    with pytest.raises(FatalClientError) as err:
        parse_mpub_body(body, MAX_MSG, MAX_BODY)
    assert _fatal(err) == ("E_BAD_MESSAGE", "MPUB message too big 500 > 100")


@pytest.mark.parametrize("surplus", [b"\x00", b"junk", _i32(1) + b"z"])
def test_mpub_surplus_bytes_are_refused(surplus):
    # README: the one deliberate difference (nsqd would read the surplus as the next command)
    body = encode_mpub_body([b"a", b"bc"]) + surplus
    with pytest.raises(FatalClientError) as err:
        parse_mpub_body(body, MAX_MSG, MAX_BODY)
    assert _fatal(err) == ("E_BAD_BODY", f"MPUB invalid message count 2 for body size {len(body)}")


# --- messages ---------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(msg_ids, st.integers(-(2**63), 2**63 - 1), st.integers(0, 65535), bodies)
def test_message_round_trip(msg_id, ts, attempts, body):
    wire = encode_message(msg_id, ts, attempts, body)
    assert len(wire) == MIN_VALID_MSG_LENGTH + len(body)
    assert wire[:8] == ts.to_bytes(8, "big", signed=True)
    assert wire[8:10] == attempts.to_bytes(2, "big")
    assert wire[10:26] == msg_id
    assert decode_message(wire) == DecodedMessage(msg_id, ts, attempts, body)
    assert decode_message(memoryview(wire)) == DecodedMessage(msg_id, ts, attempts, body)


@settings(max_examples=100, deadline=None)
@given(msg_ids, st.integers(0, 2**63 - 1), st.integers(0, 65535), bodies)
def test_message_frame_is_a_frame_of_type_2_around_the_message(msg_id, ts, attempts, body):
    frame = encode_message_frame(msg_id, ts, attempts, body)
    assert frame == encode_frame(FRAME_TYPE_MESSAGE, encode_message(msg_id, ts, attempts, body))
    parser = FrameParser()
    parser.feed(frame)
    frame = parser.next_frame()
    assert frame is not None
    frame_type, data = frame
    assert frame_type == FRAME_TYPE_MESSAGE
    assert decode_message(data) == DecodedMessage(msg_id, ts, attempts, body)


@pytest.mark.parametrize("size", [0, 1, 25])
def test_decode_message_refuses_a_short_buffer_as_nsqd(size):
    with pytest.raises(ValueError, match=re.escape(f"invalid message buffer size ({size})")):
        decode_message(b"\x00" * size)


def test_decode_message_of_the_minimum_length_has_an_empty_body():
    assert decode_message(b"\x00" * 10 + b"a" * 16) == DecodedMessage(b"a" * 16, 0, 0, b"")


# --- frames -----------------------------------------------------------------------------------------

frames = st.one_of(
    st.tuples(st.sampled_from([FRAME_TYPE_RESPONSE, FRAME_TYPE_ERROR]), bodies),
    st.tuples(st.just(FRAME_TYPE_MESSAGE), st.tuples(msg_ids, st.integers(0, 2**62), st.integers(0, 65535), bodies)),
)


def _frame_wire(frame) -> tuple[bytes, tuple[int, bytes]]:
    frame_type, payload = frame
    if frame_type == FRAME_TYPE_MESSAGE:
        msg_id, ts, attempts, body = payload
        return encode_message_frame(msg_id, ts, attempts, body), (frame_type, encode_message(msg_id, ts, attempts, body))
    return encode_frame(frame_type, payload), (frame_type, payload)


def _frames_one_by_one(parser: FrameParser) -> list:
    return list(parser)


def _message_runs_then_the_rest(parser: FrameParser) -> list:
    """As the Spark source's connections read: message_run, then next_frame for what is not a message."""
    got: list = []
    while True:
        got.extend((FRAME_TYPE_MESSAGE, data) for data in parser.message_run())
        frame = parser.next_frame()
        if frame is None:
            return got
        got.append(frame)


@pytest.mark.parametrize("read", [_frames_one_by_one, _message_runs_then_the_rest])
@settings(max_examples=200, deadline=None)
@given(frame_list=st.lists(frames, min_size=1, max_size=10), data=st.data())
def test_frames_round_trip_under_random_chunking(read, frame_list, data):
    encoded = [_frame_wire(f) for f in frame_list]
    wire = b"".join(w for w, _ in encoded)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(wire) - 1)), max_size=30))))
    parser = FrameParser()
    got = []
    for start, end in zip([0, *cuts], [*cuts, len(wire)]):
        parser.feed(wire[start:end])
        got.extend(read(parser))
    assert got == [expected for _, expected in encoded]
    assert parser.take_buffered() == b""


@settings(max_examples=40, deadline=None)
@given(st.lists(frames, min_size=1, max_size=4))
def test_frames_round_trip_fed_one_byte_at_a_time(frame_list):
    encoded = [_frame_wire(f) for f in frame_list]
    wire = b"".join(w for w, _ in encoded)
    parser = FrameParser()
    got = []
    for i in range(len(wire)):
        parser.feed(wire[i : i + 1])
        got.extend(parser)
    assert got == [expected for _, expected in encoded]


def test_message_run_stops_at_a_bad_size_or_another_frame_type():
    run = encode_message_frame(b"0" * 16, 1, 1, b"a") + encode_message_frame(b"1" * 16, 2, 1, b"b")
    parser = FrameParser()
    parser.feed(run + encode_frame(FRAME_TYPE_RESPONSE, b"OK") + run)
    assert [m[10:] for m in parser.message_run()] == [b"0" * 16 + b"a", b"1" * 16 + b"b"]
    assert parser.message_run() == []
    assert parser.next_frame() == (FRAME_TYPE_RESPONSE, b"OK")
    assert len(parser.message_run()) == 2
    parser.feed(run[:30])  # a message frame still arriving: nothing yet, and it stays
    assert parser.message_run() == []
    parser.feed(run[30:])
    assert len(parser.message_run()) == 2
    parser.feed(run + (3).to_bytes(4, "big") + b"\x00\x00\x00\x02")
    assert len(parser.message_run()) == 2  # the messages before a bad size, then next_frame refuses it
    with pytest.raises(ValueError):
        parser.next_frame()


def test_heartbeat_and_ok_frames_on_the_wire():
    assert encode_frame(FRAME_TYPE_RESPONSE, HEARTBEAT) == b"\x00\x00\x00\x0f\x00\x00\x00\x00_heartbeat_"
    assert encode_frame(FRAME_TYPE_ERROR, b"E_INVALID x") == b"\x00\x00\x00\x0f\x00\x00\x00\x01E_INVALID x"


@pytest.mark.parametrize("size", [-1, 0, 3])
def test_frame_size_below_four_is_an_error(size):
    parser = FrameParser()
    parser.feed(size.to_bytes(4, "big", signed=True) + b"\x00\x00\x00\x00")
    with pytest.raises(ValueError):
        parser.next_frame()


def test_frame_larger_than_the_limit_is_refused_from_its_header():
    parser = FrameParser(max_frame_size=1000)
    parser.feed((1001).to_bytes(4, "big") + b"\x00\x00\x00\x00")  # the header alone
    with pytest.raises(ValueError):
        parser.next_frame()


def test_empty_frame_body_is_allowed():
    parser = FrameParser()
    parser.feed(encode_frame(FRAME_TYPE_RESPONSE, b""))
    assert list(parser) == [(FRAME_TYPE_RESPONSE, b"")]


# --- parse_int (nsqd's ByteToBase10) -----------------------------------------------------------------


@pytest.mark.parametrize("value", [b"", b"-1", b"+1", b"1a", b" 1", b"1 ", b"1.0", b"0x10", "１".encode(), "٣".encode(), b"1_000"])
def test_parse_int_refuses(value):
    with pytest.raises(ValueError):
        parse_int(value)


def test_parse_int_refuses_non_ascii_digits_given_as_str():
    # str.isdigit() is true for "１" and "٣": they must still be refused
    for value in ("１", "٣", "1１"):
        with pytest.raises(ValueError):
            parse_int(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value, expected", [(b"0", 0), (b"007", 7), (b"2500", 2500), (b"18446744073709551615", 2**64 - 1)])
def test_parse_int_accepts_ascii_digits(value, expected):
    assert parse_int(value) == expected


@given(st.binary(max_size=12))
def test_parse_int_accepts_exactly_ascii_digit_strings(value):
    if value and all(0x30 <= b <= 0x39 for b in value):
        assert parse_int(value) == int(value)
    else:
        with pytest.raises(ValueError):
            parse_int(value)


# --- IDENTIFY ---------------------------------------------------------------------------------------

BAD_JSON = ("E_BAD_BODY", "IDENTIFY failed to decode JSON body")


def test_identify_accepts_every_nsqd_field():
    raw = {
        "client_id": "cid", "hostname": "host.example", "heartbeat_interval": 30000,
        "output_buffer_size": 16384, "output_buffer_timeout": 250, "feature_negotiation": True,
        "tls_v1": True, "deflate": True, "deflate_level": 6, "snappy": False, "sample_rate": 50,
        "user_agent": "pynsq/0.9.1", "msg_timeout": 120000, "topology_region": "eu", "topology_zone": "eu-1a",
    }
    data = IdentifyData.from_json(json.dumps(raw).encode())
    for key, value in raw.items():
        assert getattr(data, key) == value, key


def test_identify_defaults_are_go_zero_values():
    assert IdentifyData.from_json(b"{}") == IdentifyData()
    d = IdentifyData()
    assert (d.client_id, d.hostname, d.heartbeat_interval, d.feature_negotiation, d.msg_timeout) == ("", "", 0, False, 0)


def test_identify_ignores_unknown_keys_and_nulls():
    body = json.dumps({
        "client_id": "c", "unknown": {"deep": [1, 2]}, "long_id_x": 3, "heartbeat_interval": None, "hostname": None,
    }).encode()
    data = IdentifyData.from_json(body)
    assert data == IdentifyData(client_id="c")


def test_identify_negative_heartbeat_interval_is_passed_through():
    # -1 disables heartbeats in nsqd; validating the range is the client's job, not the decoder's
    assert IdentifyData.from_json(b'{"heartbeat_interval": -1}').heartbeat_interval == -1


@pytest.mark.parametrize(
    "raw, client_id, hostname",
    [
        ({"short_id": "s", "long_id": "l"}, "s", "l"),
        ({"short_id": "s", "client_id": "c", "long_id": "l", "hostname": "h"}, "c", "h"),
        ({"long_id": "l"}, "", "l"),
    ],
)
def test_identify_maps_legacy_short_and_long_id(raw, client_id, hostname):
    data = IdentifyData.from_json(json.dumps(raw).encode())
    assert (data.client_id, data.hostname) == (client_id, hostname)


@pytest.mark.parametrize(
    "body",
    [
        b"", b"not json", b"{", b'{"client_id": "x",}', b"[]", b'[{"client_id": "x"}]', b'"x"', b"1", b"true",
        b"\xff\xfe{}",
        b'{"heartbeat_interval": "1000"}', b'{"heartbeat_interval": 1.5}', b'{"heartbeat_interval": true}',
        b'{"msg_timeout": [1]}', b'{"sample_rate": {}}',
        b'{"feature_negotiation": 1}', b'{"tls_v1": "true"}', b'{"snappy": 0}',
        b'{"client_id": 5}', b'{"hostname": ["h"]}', b'{"user_agent": false}',
        b'{"short_id": 5}', b"[1,2]", b'{"tls_v1": 3}',
    ],
)
def test_identify_refuses_with_nsqds_error(body):
    with pytest.raises(FatalClientError) as err:
        IdentifyData.from_json(body)
    assert _fatal(err) == BAD_JSON
    assert err.value.frame_data() == b"E_BAD_BODY IDENTIFY failed to decode JSON body"


def test_identify_takes_legacy_names_and_a_whole_float_as_an_int():
    data = IdentifyData.from_json(json.dumps({
        "short_id": "c", "long_id": "h", "feature_negotiation": True, "heartbeat_interval": 1000,
        "msg_timeout": 5000.0, "unknown_key": [1, 2],
    }).encode())
    assert (data.client_id, data.hostname, data.feature_negotiation, data.heartbeat_interval, data.msg_timeout) == (
        "c", "h", True, 1000, 5000)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(["client_id", "hostname", "user_agent", "heartbeat_interval", "msg_timeout",
                                        "tls_v1", "snappy", "deflate_level", "extra"]),
                       json_scalars, max_size=6))
def test_identify_type_rules_for_any_value(raw):
    str_fields = {"client_id", "hostname", "user_agent"}
    int_fields = {"heartbeat_interval", "msg_timeout", "deflate_level"}  # the rest are bools

    def acceptable(key, value):
        if value is None or key == "extra":
            return True
        if key in str_fields:
            return isinstance(value, str)
        if key in int_fields:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, bool)

    body = json.dumps(raw).encode()
    if all(acceptable(k, v) for k, v in raw.items()):
        data = IdentifyData.from_json(body)
        for key, value in raw.items():
            if key != "extra" and value is not None:
                assert getattr(data, key) == value
    else:
        with pytest.raises(FatalClientError) as err:
            IdentifyData.from_json(body)
        assert _fatal(err) == BAD_JSON


# --- errors -----------------------------------------------------------------------------------------


def test_client_errors_carry_code_text_and_fatality():
    err = ClientError("E_FIN_FAILED", "FIN failed abc: ID not in flight")
    assert not err.fatal and err.frame_data() == b"E_FIN_FAILED FIN failed abc: ID not in flight"
    fatal = FatalClientError("E_INVALID", "invalid command X")
    assert fatal.fatal and isinstance(fatal, ClientError) and str(fatal) == "E_INVALID invalid command X"


# --- FIN runs: peek_fins / skip_fins ---------------------------------------------------------------


def test_peek_fins_sees_a_run_of_complete_fin_lines_and_consumes_nothing():
    from trio_nsq.shared.protocol import CommandParser

    parser = CommandParser(lambda name, params, size: None)
    ids = [b"%016d" % i for i in range(3)]
    parser.feed(b"".join(b"FIN " + i + b"\n" for i in ids) + b"RDY 5\nFIN " + ids[0][:8])
    assert parser.peek_fins() == ids
    assert parser.peek_fins() == ids  # nothing consumed yet
    parser.skip_fins(2)
    assert parser.peek_fins() == ids[2:]
    parser.skip_fins(1)
    assert parser.peek_fins() == []  # RDY is next: the general parser takes it
    cmd = parser.next_command()
    assert (cmd.name, cmd.params) == (b"RDY", (b"5",))
    assert parser.peek_fins() == []  # an incomplete FIN waits for more bytes
    parser.feed(ids[0][8:] + b"\n")
    assert parser.peek_fins() == [ids[0]]


def test_peek_fins_leaves_other_shapes_to_next_command():
    from trio_nsq.shared.protocol import CommandParser

    for line in (b"FIN 123\n", b"FIN " + b"a" * 16 + b"\r\n", b"FINX" + b"a" * 16 + b"\n", b"fin " + b"a" * 16 + b"\n",
                 b"FIN " + b"a" * 15 + b"\r\n", b"FIN aaaa bbbbbbbbbbb\n", b"FIN aaaa\nbbbbbbbbbbb\n"):
        parser = CommandParser(lambda name, params, size: None)
        parser.feed(line)
        assert parser.peek_fins() == []
        assert parser.next_command() is not None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.sampled_from(b"FIN \n\rx")), max_size=6), st.integers(1, 9),
       st.binary(max_size=30))
def test_peek_fins_finds_exactly_the_run_the_line_rule_allows(damage, count, tail):
    """Runs of FIN lines with bytes changed anywhere (a space, a newline or "\r" inside an id, a
    broken "FIN "), cut anywhere: peek_fins gives the ids of exactly the leading lines the rule allows
    (the regular expression, applied line by line)."""
    from trio_nsq.shared.protocol import CommandParser

    data = bytearray(b"".join(b"FIN %016d\n" % i for i in range(count)))
    for offset, byte in damage:
        line = offset % count if count else 0
        data[line * 21 + offset] = byte
    data += tail
    want = []
    for p in range(0, len(data) - 20, 21):
        if not re.fullmatch(rb"FIN [^\n ]{15}[^\n\r ]\n", bytes(data[p:p + 21])):
            break
        want.append(bytes(data[p + 4:p + 20]))
    parser = CommandParser(lambda name, params, size: None)
    parser.feed(b"RDY 1\n" + data)
    assert parser.next_command() == Command(b"RDY", (b"1",))  # the run starts past the buffer's front
    assert parser.peek_fins() == want
