"""The rules of replication (issue 52), pure: no I/O, no clock, nothing of the broker.

The broker's replication code calls these with what it read from etcd and from its own log; the model
test (tests/test_replication_model.py) calls the very same functions from simulated replicas, so what the
model checks is what the broker does. Callers go through the module (`core.truncation_point(...)`), never
`from ...core import x`: the mutation tests patch `LeaderProgress.high_watermark`, `check_fetch_epoch`,
`truncation_point` and `follower_synced` here and expect the patch to reach every caller.

Kafka's names: the *ISR* (in-sync replicas) may become leader; the *high watermark* (HWM) is the position
below which every record is fsynced on every ISR member, so it survives any failure that leaves one ISR
member; the *leader epoch* numbers leaderships, each with the position where it started (the epochs list),
which is what a follower truncates by (KIP-101, KIP-279) instead of by the HWM it was last told.
Positions are a log's positions (the TopicLog's byte offsets): "end" is where the next record goes.
Times are plain floats from the caller's clock (trio.current_time() or a test's).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

Epochs = tuple[tuple[int, int], ...]


def _ids(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ValueError(f"{what} is not a list of broker ids")
    return tuple(value)


def _int(value: Any, what: str) -> int:
    # bool is an int in Python; a JSON true is not a position
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is not a non-negative integer")
    return value


@attrs.frozen
class TopicState:
    """A replicated topic as etcd holds it at `{prefix}/topics/{topic}` (the broker reads and CASes it).

    `epochs`: ((epoch, start position), ...) in increasing epoch order, one entry per leadership ever
    elected: the leader of `epoch` had its log end at `start` when elected. Starts may go down (a leader
    elected after a short-lived one that it never followed starts lower): `lineage()` is the leader's own
    history, where a record at position p was written in the last epoch whose start <= p.
    `log_id`: the leader's log id at placement; every replica's log carries it (a follower with another log id resets its log).
    """

    replicas: tuple[str, ...]
    leader: str | None
    epoch: int
    epochs: Epochs
    isr: tuple[str, ...]
    min_isr: int
    log_id: str

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "replicas": list(self.replicas),
                "leader": self.leader,
                "epoch": self.epoch,
                "epochs": [[epoch, start] for epoch, start in self.epochs],
                "isr": list(self.isr),
                "min_isr": self.min_isr,
                "log_id": self.log_id,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> TopicState:
        """Parse a value read from etcd; ValueError (one message, no traceback for the caller to log) on
        anything that is not a TopicState: a bad value is logged and left alone, never half applied."""
        try:
            value = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        leader = value.get("leader")
        if leader is not None and (not isinstance(leader, str) or not leader):
            raise ValueError("leader is not a broker id or null")
        raw_epochs = value.get("epochs")
        if not isinstance(raw_epochs, list) or not raw_epochs:
            raise ValueError("epochs is not a non-empty list")
        epochs: list[tuple[int, int]] = []
        for entry in raw_epochs:
            if not isinstance(entry, list) or len(entry) != 2:
                raise ValueError("an epochs entry is not [epoch, start]")
            epoch, start = _int(entry[0], "an epoch"), _int(entry[1], "an epoch's start")
            if epochs and epoch <= epochs[-1][0]:
                raise ValueError("epochs are not in increasing order")
            epochs.append((epoch, start))
        log_id = value.get("log_id")
        if not isinstance(log_id, str):
            raise ValueError("log_id is not a string")
        state = cls(
            replicas=_ids(value.get("replicas"), "replicas"),
            leader=leader,
            epoch=_int(value.get("epoch"), "epoch"),
            epochs=tuple(epochs),
            isr=_ids(value.get("isr"), "isr"),
            min_isr=_int(value.get("min_isr"), "min_isr"),
            log_id=log_id,
        )
        if state.epoch != epochs[-1][0]:
            raise ValueError("epoch is not the last entry of epochs")
        if not set(state.isr) <= set(state.replicas):
            raise ValueError("isr is not a subset of replicas")
        if leader is not None and leader not in state.isr:
            raise ValueError("leader is not in the isr")
        return state

    def end_of_epoch(self, epoch: int, leader_end: int) -> int:
        """Where `epoch`'s records end in the current leader's log: the start of the next epoch of the
        leader's lineage after it, else (it is the current epoch) `leader_end`. KIP-279: the list holds
        every epoch ever elected, and a short-lived leader's epoch may have been cut off by a later
        election that started lower (epochs [[1, 0], [2, 5], [3, 3]]: epoch 3's leader never had epoch
        2's records, and epoch 1's records end at 3, not 5 on it): so the earliest start of all the
        epochs listed after `epoch`, which is the start of the first one the leader's log descends from."""
        starts = [start for listed, start in self.epochs if listed > epoch]
        return min(starts) if starts else leader_end

    def lineage(self) -> Epochs:
        """The epochs the leader's log descends from: the listed ones no later epoch started at or below
        (the others' records, if any, were cut off by that later election). A follower's epoch cache
        takes its entries from here (extend_epochs)."""
        kept: list[tuple[int, int]] = []
        for epoch, start in self.epochs:
            while kept and kept[-1][1] >= start:
                kept.pop()
            kept.append((epoch, start))
        return tuple(kept)


def place(
    me: str, alive: Mapping[str, int], replicas: int, min_isr: int, my_end: int, my_empty: bool, log_id: str
) -> TopicState:
    """The TopicState the broker where a topic is first needed in cluster mode proposes (a CAS creating
    the key: the first proposal wins, the others read it). `alive`: each alive broker's id -> how many
    topics it holds; the other replicas are the least loaded, ties by id; fewer alive than `replicas`:
    all of them. The isr is every replica when this log is empty (nothing to catch up), else only `me`:
    the others join once they have fetched this log (LeaderProgress.isr_change)."""
    others = sorted((load, broker) for broker, load in alive.items() if broker != me)
    chosen = (me, *(broker for _, broker in others[: max(replicas - 1, 0)]))
    return TopicState(
        replicas=chosen,
        leader=me,
        epoch=1,
        epochs=((1, my_end),),
        isr=chosen if my_empty else (me,),
        min_isr=min_isr,
        log_id=log_id,
    )


def elect(state: TopicState, me: str, alive: Collection[str], my_end: int) -> TopicState | None:
    """What an ISR member proposes (CAS on the key's mod_revision: one candidate wins) when the leader's
    broker key is gone, the leader is null, or the leader is `me` restarted (its tail may differ from what
    followers fetched: it does not resume its old epoch). None when `me` may not lead: not in the isr (no
    unclean election), not alive, or the leader is another alive broker. The caller truncates its log as a
    follower would (truncation_point, without a leader end) BEFORE calling: `my_end` is its end after that,
    where the new epoch starts. The new isr: the old isr members still alive."""
    if me not in state.isr or me not in alive:
        return None
    if state.leader is not None and state.leader != me and state.leader in alive:
        return None
    epoch = state.epoch + 1
    return attrs.evolve(
        state,
        leader=me,
        epoch=epoch,
        epochs=(*state.epochs, (epoch, my_end)),
        isr=tuple(broker for broker in state.isr if broker == me or broker in alive),
    )


def truncation_point(
    local_epochs: Sequence[tuple[int, int]], state: TopicState, local_end: int, leader_end: int | None = None
) -> int:
    """Where a replica cuts its log before fetching from the leader of `state` (or before proposing itself,
    then without `leader_end`): KIP-101/279. Its last local epoch L (from its own fsynced epoch cache)
    ends on the leader at `state.end_of_epoch(L, leader_end)` (the earliest start listed after L, or the
    leader's end when L is the current epoch); everything of its own past that may differ from the
    leader's log and goes. Never the HWM it was told: that may be stale (KIP-101), and what is above it
    may be committed.

    A local epoch newer than the state's: this state is stale, cut nothing (the fetch is then FENCED or
    the leader steps down). No local epoch (records of unknown epoch): keep only what precedes the first
    listed epoch's start. A local epoch missing from the list (should not happen) ends the same way:
    where the earliest epoch listed after it starts."""
    if not local_epochs:
        return min(local_end, state.epochs[0][1]) if state.epochs else local_end
    last = local_epochs[-1][0]
    if last > state.epoch:
        return local_end
    if last == state.epoch:
        return local_end if leader_end is None else min(local_end, leader_end)
    return min(local_end, state.end_of_epoch(last, local_end if leader_end is None else leader_end))


def extend_epochs(
    local_epochs: Sequence[tuple[int, int]], state: TopicState, truncated_to: int, new_end: int
) -> tuple[tuple[int, int], ...]:
    """A follower's epoch cache after it truncated to `truncated_to` and then appended the leader's records
    up to `new_end`: its entries that still start below the cut, then the listed epochs after its last
    one in the leader's lineage that start below `new_end` (the leader's records at [start, next start)
    are that epoch's).
    Not in the brief's API: a helper the follower side may call (the model does)."""
    kept = [(epoch, start) for epoch, start in local_epochs if start < truncated_to]
    last = kept[-1][0] if kept else 0
    for epoch, listed_start in state.lineage():
        if epoch <= last or listed_start >= new_end:
            continue
        start = max(listed_start, truncated_to)
        if kept and kept[-1][1] == start:
            kept.pop()  # that epoch holds no record here: this one starts at the same position
        kept.append((epoch, start))
        last = epoch
    return tuple(kept)


def check_fetch_epoch(leader_epoch: int, follower_epoch: int) -> str | None:
    """The leader's check of a fetch (`GET /replica/fetch?epoch=`): None to serve it; "FENCED" when the
    follower read an older TopicState (it re-reads etcd); "STALE_LEADER" when the follower knows a newer
    epoch: this broker is no longer the leader and steps down."""
    if follower_epoch < leader_epoch:
        return "FENCED"
    if follower_epoch > leader_epoch:
        return "STALE_LEADER"
    return None


def follower_synced(appended: int, synced: int) -> int:
    """What a follower reports as its synced position in its next fetch: only what it fsynced (`synced`),
    never merely `appended`: the leader counts it towards the HWM, that is towards an OK that must
    survive a power loss of the leader."""
    return synced


@attrs.define
class _Follower:
    position: int = 0  # its log end at its last fetch: everything below is there
    synced: int = 0  # its fsynced end at its last fetch
    caught_up_at: float = 0.0  # the last time its fetch position reached the leader's log end
    reached_end: bool = False  # its last fetch position reached the leader's log end as of that fetch
    heard: bool = False  # fetched since this LeaderProgress was made


class LeaderProgress:
    """One replicated topic on its leader: followers' progress, the isr in force, the HWM.

    The broker makes one when it becomes leader (after its election CAS) and drops it when it stops
    leading. Its fetch handler calls `fetched`; its sync group `own_synced` after each fsync of the log;
    a periodic task `isr_change` (a proposal it CASes into etcd, then `applied` with whatever etcd holds
    after that CAS, won or lost); its PUB path `may_append` before appending and `committed` to answer.

    The isr in force is the state's; while a proposed change is pending (isr_change returned it and
    applied() has not been called yet) the HWM is computed over both (the maximal isr: a member being
    added counts at once, one being removed still counts), and `len(isr) >= min_isr` over the members in
    both (the minimal isr): whichever way the CAS goes, an OK never depended on a member etcd does not
    list (Kafka's pending ISR state, KIP-497).
    """

    def __init__(self, state: TopicState, me: str, now: float, own_synced: int, hwm: int = 0) -> None:
        """`hwm`: the highest HWM this broker knew as a follower. A new leader does not know what its
        followers fsynced: its HWM starts there (never past its own durable tail) and rises only once
        every isr member has fetched from it."""
        self._state = state
        self._me = me
        self._started = now
        self._own_synced = own_synced
        self._hwm = min(hwm, own_synced)
        self._pending: tuple[str, ...] | None = None
        self._followers: dict[str, _Follower] = {}
        self._advance()  # alone in its isr, its durable tail is the HWM at once

    @property
    def state(self) -> TopicState:
        """The TopicState in force (the last applied)."""
        return self._state

    def fetched(self, replica: str, position: int, synced: int, log_end: int, now: float) -> None:
        """A fetch from `replica` at `position` (its log end) with `synced` (its fsynced end), while this
        leader's log ended at `log_end`: it is caught up when position >= log_end."""
        follower = self._followers.get(replica)
        if follower is None:
            follower = self._followers[replica] = _Follower(caught_up_at=self._started)
        follower.position = position
        follower.synced = min(synced, position)
        follower.heard = True
        follower.reached_end = position >= log_end
        if follower.reached_end:
            follower.caught_up_at = now
        self._advance()

    def own_synced(self, position: int) -> None:
        """This leader's durable tail moved (its log was fsynced up to `position`)."""
        self._own_synced = max(self._own_synced, position)
        self._advance()

    def _maximal_isr(self) -> set[str]:
        members = set(self._state.isr)
        if self._pending is not None:
            members.update(self._pending)
        return members

    def _minimal_isr(self) -> set[str]:
        members = set(self._state.isr)
        if self._pending is not None:
            members.intersection_update(self._pending)
        return members

    def _advance(self) -> None:
        # HWM = min synced over the maximal isr; a member not heard from holds it where it is
        lowest = self._own_synced
        for member in self._maximal_isr():
            if member == self._me:
                continue
            follower = self._followers.get(member)
            if follower is None or not follower.heard:
                return
            lowest = min(lowest, follower.synced)
        self._hwm = max(self._hwm, lowest)

    @property
    def high_watermark(self) -> int:
        """Everything below it is fsynced on every isr member (this leader's durable tail included);
        it never decreases. The mutation test replaces this property with the leader's own synced."""
        return self._hwm

    def isr_change(self, now: float, lag_time: float, log_end: int) -> tuple[str, ...] | None:
        """The isr to propose (CAS in etcd, then `applied`), or None when nothing changes. Out: an isr
        member whose fetches have not reached the leader's log end for `lag_time` (a member never heard
        from counts from when this leader started). In: a replica whose synced >= HWM and whose last
        fetch reached the leader's log end (as of that fetch, or `log_end` now). The leader stays in."""
        current = set(self._state.isr)
        members = set(current)
        for replica in self._state.replicas:
            if replica == self._me:
                members.add(replica)
                continue
            follower = self._followers.get(replica)
            if replica in current:
                # only a fetch counts: a follower that stopped fetching at the end of an idle log
                # lags all the same (Kafka's lastCaughtUpTime), or a dead one would hold the HWM forever
                caught_up_at = self._started if follower is None else follower.caught_up_at
                if now - caught_up_at > lag_time:
                    members.discard(replica)
            elif (
                follower is not None
                and follower.heard
                and (follower.reached_end or follower.position >= log_end)
                and follower.synced >= self.high_watermark
            ):
                members.add(replica)
        if members == current:
            return None
        proposal = tuple(replica for replica in self._state.replicas if replica in members)
        self._pending = proposal
        return proposal

    def applied(self, state: TopicState) -> None:
        """The state etcd now holds for this topic, after a CAS of this leader's (won or lost) or when a
        watch saw it change; the caller drops this LeaderProgress instead when `state` has another leader
        or epoch."""
        self._state = state
        self._pending = None
        self._advance()

    def may_append(self) -> str | None:
        """Before appending a publish: None, or why it is refused (definite: not appended).
        Leadership and the lease are the caller's checks."""
        if len(self._minimal_isr()) < self._state.min_isr:
            return "NOT_ENOUGH_REPLICAS"
        return None

    def committed(self, position: int) -> bool:
        """May a publish that appended up to `position` be answered OK: HWM >= position and
        len(isr) >= min_isr (leadership and the lease are the caller's checks)."""
        return self.high_watermark >= position and len(self._minimal_isr()) >= self._state.min_isr
