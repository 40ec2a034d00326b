"""Protocol V2's state machine: a client's states, which command each state allows, and the checks nsqd
makes before a command runs. Pure (no I/O), as h11 keeps its state table apart from its connection.

nsqd spreads these checks over its command handlers (protocol_v2.go); gathered here they are one
table, read by `check_command`, which both the command parser's early check (a body command, before
its body is read) and `ProtocolV2.exec` call. The checks run in nsqd's order: the TLS policy (every
command but IDENTIFY), a known command, the client's state, the parameter count. What a handler checks
after those (a topic name, SUB's heartbeats, a message id) stays in the handler.
"""

from __future__ import annotations

import enum

import attrs

from trio_nsq.shared.protocol import FatalClientError


class ClientState(enum.IntEnum):
    """nsqd's client states, with its numbers (they appear as `state` in /stats)."""

    INIT = 0
    DISCONNECTED = 1
    CONNECTED = 2
    SUBSCRIBED = 3
    CLOSING = 4


_CONSUMING = frozenset({ClientState.SUBSCRIBED, ClientState.CLOSING})
_ANY = frozenset(ClientState)


@attrs.frozen
class Rule:
    """`states`: where the command is allowed. `params`: the fewest parameters after the name (or
    exactly that many when `exact`), and nsqd's wording when there are not (it varies by command)."""

    states: frozenset[ClientState]
    params: int = 0
    exact: bool = False
    too_few: str = "insufficient number of parameters"


RULES: dict[bytes, Rule] = {
    b"IDENTIFY": Rule(frozenset({ClientState.INIT})),
    b"AUTH": Rule(frozenset({ClientState.INIT}), 0, exact=True, too_few="invalid number of parameters"),
    # SUB's parameters are counted in its handler: nsqd refuses heartbeats disabled first
    b"SUB": Rule(frozenset({ClientState.INIT})),
    # RDY after CLS is ignored by its handler, not refused
    b"RDY": Rule(_CONSUMING),
    b"FIN": Rule(_CONSUMING, 1, too_few="insufficient number of params"),
    b"REQ": Rule(_CONSUMING, 2, too_few="insufficient number of params"),
    b"TOUCH": Rule(_CONSUMING, 1, too_few="insufficient number of params"),
    b"CLS": Rule(frozenset({ClientState.SUBSCRIBED})),
    b"NOP": Rule(_ANY),
    b"PUB": Rule(_ANY, 1),
    b"MPUB": Rule(_ANY, 1),
    b"DPUB": Rule(_ANY, 2),
}


def check_command(name: bytes, nparams: int, state: ClientState, tls_ok: bool) -> None:
    """Raise nsqd's FatalClientError if `name` with `nparams` parameters may not run now. `tls_ok` is
    False when --tls-required applies to this client and it has not upgraded to TLS."""
    cmd = name.decode(errors="replace")
    if not tls_ok and name != b"IDENTIFY":
        raise FatalClientError("E_INVALID", f"cannot {cmd} in current state (TLS required)")
    rule = RULES.get(name)
    if rule is None:
        raise FatalClientError("E_INVALID", f"invalid command {cmd}")
    if state not in rule.states:
        raise FatalClientError("E_INVALID", f"cannot {cmd} in current state")
    if nparams < rule.params or (rule.exact and nparams != rule.params):
        raise FatalClientError("E_INVALID", f"{cmd} {rule.too_few}")
