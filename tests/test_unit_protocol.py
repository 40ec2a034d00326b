"""The sans-IO V2 codec on its own: round trips under any chunking, and nsqd's errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol import (
    FRAME_TYPE_MESSAGE,
    ClientError,
    Command,
    CommandParser,
    FatalClientError,
    FrameParser,
    IdentifyData,
    decode_message,
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

names = st.from_regex(r"[.a-zA-Z0-9_-]{1,64}", fullmatch=True)
bodies = st.binary(min_size=1, max_size=300)
msg_ids = st.binary(min_size=16, max_size=16).map(lambda b: b.hex()[:16].encode())


def _no_check(name, params, size):
    return None


@st.composite
def commands(draw):
    kind = draw(st.sampled_from(["pub", "mpub", "dpub", "sub", "rdy", "fin", "req", "touch", "nop", "identify"]))
    topic = draw(names)
    if kind == "pub":
        body = draw(bodies)
        return encode_pub(topic, body), Command(b"PUB", (topic.encode(),), body)
    if kind == "mpub":
        msgs = draw(st.lists(bodies, min_size=1, max_size=5))
        return encode_mpub(topic, msgs), Command(b"MPUB", (topic.encode(),), encode_mpub_body(msgs))
    if kind == "dpub":
        delay, body = draw(st.integers(0, 10**6)), draw(bodies)
        return encode_dpub(topic, delay, body), Command(b"DPUB", (topic.encode(), str(delay).encode()), body)
    if kind == "sub":
        channel = draw(names)
        return encode_sub(topic, channel), Command(b"SUB", (topic.encode(), channel.encode()))
    if kind == "rdy":
        n = draw(st.integers(0, 2500))
        return encode_rdy(n), Command(b"RDY", (str(n).encode(),))
    if kind in ("fin", "touch"):
        msg_id = draw(msg_ids)
        encoder = encode_fin if kind == "fin" else encode_touch
        return encoder(msg_id), Command(kind.upper().encode(), (msg_id,))
    if kind == "req":
        msg_id, delay = draw(msg_ids), draw(st.integers(0, 10**6))
        return encode_req(msg_id, delay), Command(b"REQ", (msg_id, str(delay).encode()))
    if kind == "identify":
        data = {"client_id": topic, "heartbeat_interval": draw(st.integers(1000, 60000))}
        return encode_identify(data), Command(b"IDENTIFY", (), json.dumps(data).encode())
    return encode_nop(), Command(b"NOP", ())


@settings(max_examples=200, deadline=None)
@given(st.lists(commands(), min_size=1, max_size=8), st.lists(st.integers(1, 64), min_size=1, max_size=20))
def test_commands_round_trip_under_any_chunking(cmds, cuts):
    wire = b"".join(w for w, _ in cmds)
    parser = CommandParser(_no_check)
    got = []
    pos, i = 0, 0
    while pos < len(wire):
        step = cuts[i % len(cuts)]
        parser.feed(wire[pos : pos + step])
        pos += step
        i += 1
        while (cmd := parser.next_command()) is not None:
            got.append(cmd)
    assert got == [c for _, c in cmds]
    assert parser.buffered() == 0


def test_body_size_is_checked_before_the_body_arrives():
    calls = []

    def check(name, params, size):
        calls.append((name, params, size))
        if size is not None and size > 10:
            raise FatalClientError("E_BAD_MESSAGE", f"PUB message too big {size} > 10")

    parser = CommandParser(check)
    parser.feed(b"PUB t\n")
    assert parser.next_command() is None
    assert calls == [(b"PUB", (b"t",), None)]  # params first, as nsqd checks them before the size
    parser.feed((1000).to_bytes(4, "big"))  # only the size, none of the body
    with pytest.raises(FatalClientError) as err:
        parser.next_command()
    assert err.value.frame_data() == b"E_BAD_MESSAGE PUB message too big 1000 > 10"


def test_line_too_long_is_fatal_even_without_newline():
    parser = CommandParser(_no_check, max_line_length=100)
    parser.feed(b"X" * 101)
    with pytest.raises(FatalClientError):
        parser.next_command()


def test_crlf_is_accepted():
    parser = CommandParser(_no_check)
    parser.feed(b"NOP\r\nRDY 5\r\n")
    assert parser.next_command() == Command(b"NOP", ())
    assert parser.next_command() == Command(b"RDY", (b"5",))


@given(st.lists(bodies, min_size=1, max_size=50))
def test_mpub_body_round_trip(msgs):
    assert parse_mpub_body(encode_mpub_body(msgs), 1 << 20, 5 << 20) == msgs


@pytest.mark.parametrize(
    "body, code, text",
    [
        ((0).to_bytes(4, "big"), "E_BAD_BODY", "MPUB invalid message count 0"),
        ((10**6).to_bytes(4, "big"), "E_BAD_BODY", "MPUB invalid message count 1000000"),
        ((1).to_bytes(4, "big") + (0).to_bytes(4, "big"), "E_BAD_MESSAGE", "MPUB invalid message(0) body size 0"),
        ((1).to_bytes(4, "big") + (101).to_bytes(4, "big") + b"x" * 101, "E_BAD_MESSAGE", "MPUB message too big 101 > 100"),
        ((2).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"x", "E_BAD_MESSAGE", "MPUB failed to read message(1) body size"),
        ((1).to_bytes(4, "big") + (5).to_bytes(4, "big") + b"xx", "E_BAD_MESSAGE", "MPUB failed to read message body"),
    ],
)
def test_mpub_errors_match_nsqd(body, code, text):
    with pytest.raises(FatalClientError) as err:
        parse_mpub_body(body, 100, 1000)
    assert (err.value.code, err.value.description) == (code, text)


def test_mpub_surplus_bytes_are_refused():
    body = encode_mpub_body([b"a"]) + b"junk"
    with pytest.raises(FatalClientError) as err:
        parse_mpub_body(body, 100, 1000)
    assert err.value.code == "E_BAD_BODY"


@given(msg_ids, st.integers(0, 2**63 - 1), st.integers(0, 65535), st.binary(max_size=500))
def test_message_round_trip(msg_id, ts, attempts, body):
    decoded = decode_message(encode_message(msg_id, ts, attempts, body))
    assert (decoded.id, decoded.timestamp, decoded.attempts, decoded.body) == (msg_id, ts, attempts, body)


@given(st.lists(st.tuples(msg_ids, bodies), min_size=1, max_size=10), st.integers(1, 50))
def test_frames_round_trip_under_chunking(msgs, step):
    wire = b"".join(encode_message_frame(i, 1, 1, b) for i, b in msgs) + encode_frame(0, b"OK")
    parser = FrameParser()
    frames = []
    for pos in range(0, len(wire), step):
        parser.feed(wire[pos : pos + step])
        frames.extend(parser)
    assert frames[-1] == (0, b"OK")
    assert [(t, decode_message(d).body) for t, d in frames[:-1]] == [(FRAME_TYPE_MESSAGE, b) for _, b in msgs]


@pytest.mark.parametrize("value", [b"", b"-1", b"1a", b" 1", "１".encode(), b"+3"])
def test_parse_int_refuses_what_nsqd_refuses(value):
    with pytest.raises(ValueError):
        parse_int(value)


def test_identify_fields_and_legacy_names():
    data = IdentifyData.from_json(json.dumps({
        "short_id": "c", "long_id": "h", "feature_negotiation": True, "heartbeat_interval": 1000,
        "msg_timeout": 5000.0, "unknown_key": [1, 2],
    }).encode())
    assert (data.client_id, data.hostname, data.feature_negotiation, data.heartbeat_interval, data.msg_timeout) == (
        "c", "h", True, 1000, 5000)


@pytest.mark.parametrize("body", [b"not json", b"[1,2]", b'{"heartbeat_interval": "x"}', b'{"tls_v1": 3}'])
def test_identify_bad_bodies(body):
    with pytest.raises(FatalClientError) as err:
        IdentifyData.from_json(body)
    assert err.value.frame_data() == b"E_BAD_BODY IDENTIFY failed to decode JSON body"


def test_client_error_is_not_fatal():
    assert not ClientError("E_FIN_FAILED", "x").fatal
    assert FatalClientError("E_INVALID", "x").fatal
