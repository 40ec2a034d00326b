"""Protocol V2's state table (broker/client_state.py), without sockets: every command in every state,
with nsqd's texts. The same cases were checked against Go nsqd 1.3.0 over a socket (identical frames)."""

import pytest

from trio_nsq.broker.client_state import RULES, ClientState, check_command
from trio_nsq.shared.protocol import FatalClientError

INIT, SUBSCRIBED, CLOSING = ClientState.INIT, ClientState.SUBSCRIBED, ClientState.CLOSING


def refusal(name: bytes, nparams: int, state: ClientState, tls_ok: bool = True) -> str | None:
    try:
        check_command(name, nparams, state, tls_ok)
    except FatalClientError as exc:
        assert exc.code == "E_INVALID"
        return exc.description
    return None


def test_states_keep_nsqds_numbers_for_stats():
    assert [int(s) for s in (ClientState.INIT, ClientState.DISCONNECTED, ClientState.CONNECTED,
                             ClientState.SUBSCRIBED, ClientState.CLOSING)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("name, nparams, state, expected", [
    (b"IDENTIFY", 0, INIT, None),
    (b"IDENTIFY", 0, SUBSCRIBED, "cannot IDENTIFY in current state"),
    (b"AUTH", 0, INIT, None),
    (b"AUTH", 1, INIT, "AUTH invalid number of parameters"),
    (b"AUTH", 0, SUBSCRIBED, "cannot AUTH in current state"),
    (b"SUB", 2, INIT, None),
    (b"SUB", 2, SUBSCRIBED, "cannot SUB in current state"),
    (b"SUB", 0, INIT, None),  # counted by SUB itself, after the heartbeat check (nsqd's order)
    (b"RDY", 1, INIT, "cannot RDY in current state"),
    (b"RDY", 1, SUBSCRIBED, None),
    (b"RDY", 1, CLOSING, None),  # ignored by RDY, not refused
    (b"FIN", 1, INIT, "cannot FIN in current state"),
    (b"FIN", 0, INIT, "cannot FIN in current state"),  # the state before the count
    (b"FIN", 0, SUBSCRIBED, "FIN insufficient number of params"),
    (b"FIN", 1, CLOSING, None),
    (b"REQ", 1, SUBSCRIBED, "REQ insufficient number of params"),
    (b"REQ", 2, CLOSING, None),
    (b"TOUCH", 0, SUBSCRIBED, "TOUCH insufficient number of params"),
    (b"CLS", 0, INIT, "cannot CLS in current state"),
    (b"CLS", 0, CLOSING, "cannot CLS in current state"),
    (b"CLS", 0, SUBSCRIBED, None),
    (b"NOP", 0, CLOSING, None),
    (b"PUB", 0, SUBSCRIBED, "PUB insufficient number of parameters"),
    (b"PUB", 1, SUBSCRIBED, None),
    (b"MPUB", 0, INIT, "MPUB insufficient number of parameters"),
    (b"DPUB", 1, INIT, "DPUB insufficient number of parameters"),
    (b"DPUB", 2, INIT, None),
    (b"BOGUS", 0, INIT, "invalid command BOGUS"),
])
def test_command_in_state(name, nparams, state, expected):
    assert refusal(name, nparams, state) == expected


def test_tls_required_comes_first_for_all_but_identify():
    assert refusal(b"IDENTIFY", 0, INIT, tls_ok=False) is None
    for name in set(RULES) - {b"IDENTIFY"}:
        assert refusal(name, 0, SUBSCRIBED, tls_ok=False) == f"cannot {name.decode()} in current state (TLS required)"
    assert refusal(b"BOGUS", 0, INIT, tls_ok=False) == "cannot BOGUS in current state (TLS required)"
