"""shared/names.py against nsqd's internal/protocol/names.go.

Go: `len(name) > 64 || len(name) < 1` is invalid (len counts bytes, "#ephemeral" included), then
`^[.a-zA-Z0-9_-]+(#ephemeral)?$` must match. Go's `$` without (?m) matches only at the very end of the
text, so a trailing newline is invalid (Python's `$` would accept it: the reference below uses `\\Z`).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_nsq.shared.names import (
    EPHEMERAL_SUFFIX,
    MAX_NAME_LENGTH,
    is_ephemeral,
    is_valid_channel_name,
    is_valid_topic_name,
)

# Go's regexp, with Go's end-of-text `$`
_GO_REGEX = re.compile(r"^[.a-zA-Z0-9_-]+(#ephemeral)?\Z")


def go_is_valid_name(name: str | bytes) -> bool:
    """protocol.isValidName on string(name): byte length first, then the regexp."""
    raw = name if isinstance(name, bytes) else name.encode("utf-8", "surrogatepass")
    if len(raw) > 64 or len(raw) < 1:
        return False
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return False  # no byte outside ASCII can match the class
    return _GO_REGEX.search(text) is not None


BOTH = pytest.mark.parametrize("check", [is_valid_topic_name, is_valid_channel_name], ids=["topic", "channel"])

VALID = [
    "a", "A", "0", ".", "_", "-", "..", "a.b_c-d", "UPPER.lower_09", "a" * 64,
    "a#ephemeral", "a" * 54 + "#ephemeral", "-#ephemeral", "..#ephemeral", "ephemeral", "x" * 63 + "e",
]
INVALID = [
    "", "a" * 65, "a" * 55 + "#ephemeral", "#ephemeral", "a#ephemeral#ephemeral", "a#", "a#b", "a#Ephemeral",
    "a#ephemeral ", "a#ephemeralx", "a b", " a", "a ", "a\t", "a/b", "a:b", "a*", "a+b", "a,b", "é", "aé",
    "a\n", "a\r\n", "a#ephemeral\n", "\na", "a\nb", "a\x00", "\u0661", "ａ", "a\u200b",
]


@BOTH
@pytest.mark.parametrize("name", VALID)
def test_valid_names(check, name):
    assert go_is_valid_name(name)  # the table itself agrees with Go
    assert check(name)
    assert check(name.encode())


@BOTH
@pytest.mark.parametrize("name", INVALID)
def test_invalid_names(check, name):
    assert not go_is_valid_name(name)
    assert not check(name)
    assert not check(name.encode("utf-8"))


@BOTH
def test_length_limits_count_the_ephemeral_suffix(check):
    assert MAX_NAME_LENGTH == 64 and EPHEMERAL_SUFFIX == "#ephemeral"
    for n in range(1, 70):
        assert check("t" * n) == (n <= 64), n
        assert check("t" * n + "#ephemeral") == (n + 10 <= 64), n


@BOTH
def test_trailing_newline_is_invalid(check):
    # the one place a Python `$` and Go's `$` differ
    for name in ("topic\n", "topic#ephemeral\n", "a" * 63 + "\n"):
        assert not check(name) and not check(name.encode())


@BOTH
@pytest.mark.parametrize("raw", [b"\xff", b"abc\xff", b"\xc3\xa9", b"a\x80", b"\xe2\x80\x8b"])
def test_bytes_that_are_not_ascii_are_invalid(check, raw):
    assert not check(raw)


@BOTH
def test_bytes_and_str_agree(check):
    for name in VALID + INVALID:
        assert check(name) == check(name.encode())


def test_topic_and_channel_rules_are_the_same():
    for name in VALID + INVALID:
        assert is_valid_topic_name(name) == is_valid_channel_name(name)


def test_is_ephemeral():
    assert is_ephemeral("a#ephemeral") and is_ephemeral("a" * 54 + "#ephemeral")
    assert not is_ephemeral("a") and not is_ephemeral("ephemeral") and not is_ephemeral("a#ephemeralx")


_ALPHABET = "aZ09._-#ephmrl \n\r\t/é\x00"


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.text(alphabet=_ALPHABET, max_size=80),
        st.from_regex(r"[.a-zA-Z0-9_-]{0,70}(#ephemeral)?\n?", fullmatch=True),
        st.text(max_size=70),
    )
)
def test_str_names_match_go(name):
    expected = go_is_valid_name(name)
    assert is_valid_topic_name(name) == expected
    assert is_valid_channel_name(name) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=70),
        st.from_regex(rb"[.a-zA-Z0-9_-]{0,70}(#ephemeral)?\n?", fullmatch=True),
    )
)
def test_bytes_names_match_go(name):
    expected = go_is_valid_name(name)
    assert is_valid_topic_name(name) == expected
    assert is_valid_channel_name(name) == expected


# --- merged from test_unit_core.py -----------------------------------------------------------


_REFERENCE = re.compile(r"^[.a-zA-Z0-9_-]+(#ephemeral)?$")


@given(st.text(alphabet="abcXYZ019._-#ephemral\n ", max_size=80))
def test_names_follow_nsqd(name):
    expected = 1 <= len(name) <= 64 and _REFERENCE.fullmatch(name) is not None and "\n" not in name
    assert is_valid_topic_name(name) == expected
    assert is_valid_channel_name(name) == expected


def test_name_edges():
    assert is_valid_topic_name("a" * 64) and not is_valid_topic_name("a" * 65)
    assert is_valid_topic_name("a" * 54 + "#ephemeral")  # the suffix counts toward 64
    assert not is_valid_topic_name("a" * 55 + "#ephemeral")
    assert not is_valid_topic_name("topic\n") and not is_valid_topic_name("")
    assert is_valid_topic_name(b"bytes.ok") and not is_valid_topic_name(b"\xff")
    assert is_ephemeral("x#ephemeral") and not is_ephemeral("x")
