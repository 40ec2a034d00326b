"""A model of replication (issue 52) driven only through trio_nsq/broker/replication/core.py.

`World` simulates what the broker's I/O side does around the pure rules, with plain data: an etcd (a dict
with a revision counter, CAS by mod_revision, leases that expire when the clock passes them), three
brokers each with a log (position = index, a record = its producer op's id), an fsynced prefix and an
fsynced epoch cache, producers' ops and a consumer. Every decision (placement, election, truncation,
the fetch's epoch check, what a follower reports as synced, the ISR, the HWM, when a publish is OK) is a
call into `core` through the module, as the broker makes it: so the model tests the real rules, and the
mutation tests at the end patch those functions and watch the model lose what it answered OK.

Faults: kill -9 (memory lost; the page cache, so the log, kept), power loss (the log cut to its fsynced
prefix), restart, pause (the process stops; its memory, leadership and lease view are kept: it wakes up
later and takes publishes), the clock (leases expire, lag grows, publishes time out).
Invariants after every step: every op answered OK is in the log of every isr member at its position;
the isr members' logs agree below the highest HWM a leader reached. At the end (`finish`): heal, restart
everything, let a leader be elected and the followers catch up, drain the leader, and the history
checker (tests/replication_checker.py) must find nothing lost, unexpected or divergent.

The tests: the random search (hypothesis, derandomized); the scripted cases (a)-(d) of the brief on the
same World; the four mutations (each scripted scenario valid with the rules, losing an OK with the rule
patched out; two of them also found by the random search); KIP-279's epochs list whose starts go down;
and the rules one by one at their edges.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from tests.replication_checker import Op, Report, check
from trio_nsq.broker.replication import core

TTL = 2.0  # --etcd-lease-ttl as the tests run brokers
LAG = 2.0  # --replica-lag-time
ACK = 5.0  # --replica-ack-timeout
BATCH = 2  # records a fetch answers at most (its max_bytes)
TOPIC = "topics/t"
IDS = ("b0", "b1", "b2")


class Etcd:
    """etcd's KV as the brokers use it: revisions, CAS on mod_revision (0: create), leases."""

    def __init__(self) -> None:
        self.kv: dict[str, tuple[bytes, int, int | None]] = {}  # key -> (value, mod_revision, lease)
        self.revision = 0
        self.leases: dict[int, float] = {}  # lease -> expiry
        self.next_lease = 1

    def expire(self, now: float) -> None:
        for lease, expiry in list(self.leases.items()):
            if expiry <= now:
                del self.leases[lease]
                for key in [key for key, (_, _, owner) in self.kv.items() if owner == lease]:
                    del self.kv[key]
                    self.revision += 1

    def grant(self, now: float) -> int:
        lease = self.next_lease
        self.next_lease += 1
        self.leases[lease] = now + TTL
        return lease

    def keepalive(self, lease: int, now: float) -> bool:
        if lease not in self.leases:
            return False
        self.leases[lease] = now + TTL
        return True

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        self.revision += 1
        self.kv[key] = (value, self.revision, lease)
        return self.revision

    def get(self, key: str) -> tuple[bytes, int] | None:
        held = self.kv.get(key)
        return None if held is None else (held[0], held[1])

    def cas(self, key: str, mod_revision: int, value: bytes) -> int | None:
        held = self.kv.get(key)
        if (0 if held is None else held[1]) != mod_revision:
            return None
        return self.put(key, value)

    def alive(self) -> set[str]:
        return {key.split("/", 1)[1] for key in self.kv if key.startswith("brokers/")}

    def topic(self) -> tuple[core.TopicState, int]:
        held = self.get(TOPIC)
        assert held is not None
        return core.TopicState.from_json(held[0]), held[1]


@attrs.define
class Broker:
    """One trio-nsqd: what survives a kill (log, fsynced prefix, epoch cache) and its memory."""

    id: str
    log: list[bytes] = attrs.Factory(list)
    synced: int = 0  # the fsynced prefix: what a power loss leaves
    epochs: tuple[tuple[int, int], ...] = ()  # the epoch cache (<topic>.replica.dat, fsynced on change)
    up: bool = True
    paused: bool = False
    # memory, lost by kill -9 and power loss
    lease: int | None = None
    lease_deadline: float = 0.0  # when the last keepalive was sent + TTL
    state: core.TopicState | None = None
    rev: int = 0
    fetch_epoch: int = 0  # the epoch it truncated for (once per leader epoch, before fetching)
    told_hwm: int = 0  # the highest HWM a leader told it
    progress: core.LeaderProgress | None = None
    pending: list[tuple[int, int]] = attrs.Factory(list)  # (op index, end position) awaiting an answer

    def hwm(self) -> int:
        """What /log/read serves up to: the leader's HWM; a follower's, min(told, its durable tail)."""
        if self.progress is not None:
            return self.progress.high_watermark
        return min(self.told_hwm, self.synced)

    def truncate(self, point: int) -> None:
        """TopicLog.truncate_to and the epoch cache with it: durable on return."""
        if point < len(self.log):
            del self.log[point:]
        self.synced = min(self.synced, point)
        self.epochs = tuple((epoch, start) for epoch, start in self.epochs if start < point)
        self.told_hwm = min(self.told_hwm, point)


@attrs.define
class PubOp:
    id: str
    invoked: float
    result: str | None = None  # None while waiting for the answer
    position: int = -1


class World:
    """The simulated cluster. Each public method is one step; `settle` (answer what can be answered)
    runs after each, as the brokers answer as soon as they may."""

    def __init__(self, min_isr: int = 2) -> None:
        self.now = 0.0
        self.etcd = Etcd()
        self.brokers = [Broker(broker_id) for broker_id in IDS]
        self.ops: list[PubOp] = []
        self.delivered: list[str] = []
        self.consumed = 0  # the consumer's channel cursor
        self.max_hwm = 0  # the highest HWM the leader of the current epoch reached
        for broker in self.brokers:
            self._register(broker)
        first = self.brokers[0]
        state = core.place(first.id, {broker.id: 0 for broker in self.brokers}, 3, min_isr, 0, True, "log-1")
        rev = self.etcd.cas(TOPIC, 0, state.to_json())
        assert rev is not None
        self._lead(first, state, rev)
        for broker in self.brokers[1:]:
            self._sync(broker)

    # -- helpers (not steps) ------------------------------------------------------------------------

    def by_id(self, broker_id: str) -> Broker:
        return self.brokers[IDS.index(broker_id)]

    def _register(self, broker: Broker) -> None:
        broker.lease = self.etcd.grant(self.now)
        broker.lease_deadline = self.now + TTL
        self.etcd.put(f"brokers/{broker.id}", b"{}", broker.lease)

    def _active(self, broker: Broker) -> bool:
        return broker.up and not broker.paused

    def _lease_live(self, broker: Broker) -> bool:
        return self.now < broker.lease_deadline

    def _lead(self, broker: Broker, state: core.TopicState, rev: int) -> None:
        broker.state, broker.rev, broker.fetch_epoch = state, rev, state.epoch
        broker.progress = core.LeaderProgress(state, broker.id, self.now, broker.synced, broker.hwm())

    def _step_down(self, broker: Broker) -> None:
        """It stops leading: publishes waiting for their answer get an error (indeterminate)."""
        broker.progress = None
        for index, _ in broker.pending:
            self.ops[index].result = "info"
        broker.pending.clear()

    def _sync(self, broker: Broker) -> None:
        """Read the topic's state from etcd and act: keep leading, step down, follow, or elect itself."""
        state, rev = self.etcd.topic()
        broker.state, broker.rev = state, rev
        if broker.progress is not None:
            if state.leader == broker.id and state.epoch == broker.progress.state.epoch:
                broker.progress.applied(state)
                return
            self._step_down(broker)
        alive = self.etcd.alive()
        if broker.id not in alive:
            return
        if state.leader is None or state.leader not in alive or state.leader == broker.id:
            # before proposing, truncate as a follower would (no leader to ask its end)
            broker.truncate(core.truncation_point(broker.epochs, state, len(broker.log)))
            proposal = core.elect(state, broker.id, alive, len(broker.log))
            if proposal is None:
                return
            new_rev = self.etcd.cas(TOPIC, rev, proposal.to_json())
            if new_rev is not None:
                self._lead(broker, proposal, new_rev)

    def settle(self) -> None:
        """Answer what can be answered: OK once committed (leader with a live lease), else an error once
        the ack timeout passed. A paused process answers nothing."""
        state, _ = self.etcd.topic()
        for broker in self.brokers:
            if not self._active(broker):
                continue
            progress = broker.progress
            if progress is not None and state.leader == broker.id and progress.state.epoch == state.epoch:
                self.max_hwm = max(self.max_hwm, progress.high_watermark)
            waiting = []
            for index, end in broker.pending:
                op = self.ops[index]
                if progress is not None and self._lease_live(broker) and progress.committed(end):
                    op.result = "ok"
                elif progress is None or self.now - op.invoked >= ACK:
                    op.result = "info"
                else:
                    waiting.append((index, end))
            broker.pending = waiting

    def violations(self) -> list[str]:
        """The invariants: every OK'd op in every isr member's log at its position; the isr members'
        logs equal below the highest HWM reached."""
        state, _ = self.etcd.topic()
        found = []
        for op in self.ops:
            if op.result != "ok":
                continue
            for member in state.isr:
                log = self.by_id(member).log
                if op.position >= len(log) or log[op.position] != op.id.encode():
                    found.append(f"ok'd {op.id} at {op.position} missing on isr member {member}")
        logs = {member: self.by_id(member).log[: self.max_hwm] for member in state.isr}
        if len({tuple(log) for log in logs.values()}) > 1:
            found.append(f"isr logs differ below the HWM {self.max_hwm}: {logs}")
        return found

    # -- steps ----------------------------------------------------------------------------------------

    def publish(self, index: int) -> PubOp:
        """A producer PUBs one message to this broker."""
        broker = self.brokers[index]
        op = PubOp(f"m{len(self.ops)}", self.now)
        self.ops.append(op)
        if not broker.up or broker.progress is None or not self._lease_live(broker):
            op.result = "fail"  # refused, or connection refused: not appended (NOT_LEADER)
        elif broker.progress.may_append() is not None:
            op.result = "fail"  # NOT_ENOUGH_REPLICAS before the append
        else:
            op.position = len(broker.log)
            broker.log.append(op.id.encode())
            broker.epochs = core.extend_epochs(broker.epochs, broker.progress.state, op.position, len(broker.log))
            broker.pending.append((len(self.ops) - 1, len(broker.log)))
        self.settle()
        return op

    def fetch(self, index: int) -> None:
        """A follower's GET /replica/fetch to the leader it knows, and what it does with the answer."""
        follower = self.brokers[index]
        state = follower.state
        if not self._active(follower) or follower.progress is not None or state is None:
            return
        if state.leader is None or state.leader == follower.id:
            return
        leader = self.by_id(state.leader)
        if not self._active(leader):
            return  # unreachable: the fetch times out
        progress = leader.progress
        if progress is None or not self._lease_live(leader):
            return  # not leading, or past its lease: it serves no fetch (and re-reads etcd)
        verdict = core.check_fetch_epoch(progress.state.epoch, state.epoch)
        if verdict == "FENCED":
            self._sync(follower)
            return
        if verdict == "STALE_LEADER":
            self._sync(leader)
            return
        if follower.fetch_epoch != state.epoch:
            # KIP-101/279, once per leader epoch (the first answer told it the leader's end)
            follower.truncate(core.truncation_point(follower.epochs, state, len(follower.log), len(leader.log)))
            follower.fetch_epoch = state.epoch
        position = len(follower.log)
        synced = core.follower_synced(position, follower.synced)
        progress.fetched(follower.id, position, synced, len(leader.log), self.now)
        records = leader.log[position : position + BATCH]
        hwm = progress.high_watermark
        follower.log.extend(records)  # TopicLog.append_at(records, their positions)
        follower.epochs = core.extend_epochs(follower.epochs, state, position, len(follower.log))
        follower.told_hwm = max(follower.told_hwm, hwm)
        self.settle()

    def fsync(self, index: int) -> None:
        broker = self.brokers[index]
        if not self._active(broker):
            return
        broker.synced = len(broker.log)
        if broker.progress is not None:
            broker.progress.own_synced(broker.synced)
        self.settle()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.etcd.expire(self.now)
        self.settle()

    def keepalive(self, index: int) -> None:
        """The lease's keepalive; a broker that finds its lease gone registers anew and re-reads etcd."""
        broker = self.brokers[index]
        if not self._active(broker):
            return
        if broker.lease is not None and self.etcd.keepalive(broker.lease, self.now):
            broker.lease_deadline = self.now + TTL
        else:
            self._register(broker)
            self._sync(broker)
        self.settle()

    def sync(self, index: int) -> None:
        """The broker's watch of the topic's key fires (or its periodic re-read)."""
        broker = self.brokers[index]
        if self._active(broker):
            self._sync(broker)
            self.settle()

    def isr_update(self, index: int) -> None:
        """The leader's periodic ISR check: a proposal CASed into etcd, then applied either way."""
        broker = self.brokers[index]
        progress = broker.progress
        if not self._active(broker) or progress is None or not self._lease_live(broker):
            return
        proposal = progress.isr_change(self.now, LAG, len(broker.log))
        if proposal is not None:
            new = attrs.evolve(progress.state, isr=proposal)
            rev = self.etcd.cas(TOPIC, broker.rev, new.to_json())
            if rev is None:
                self._sync(broker)
            else:
                broker.state, broker.rev = new, rev
                progress.applied(new)
        self.settle()

    def consume(self) -> None:
        """A consumer subscribed to the leader gets what its channel may deliver: up to the HWM."""
        state, _ = self.etcd.topic()
        leader = self.by_id(state.leader) if state.leader is not None else None
        if leader is None or not self._active(leader) or leader.progress is None:
            return
        hwm = leader.progress.high_watermark
        self.delivered.extend(record.decode() for record in leader.log[self.consumed : hwm])
        self.consumed = max(self.consumed, hwm)

    def round(self) -> None:
        """A healthy moment: every broker keeps its lease, followers fetch, everyone fsyncs, followers
        fetch again (reporting what they fsynced), the leader checks its isr; 0.3 s pass."""
        for index in range(len(self.brokers)):
            self.keepalive(index)
        for index in range(len(self.brokers)):
            self.fetch(index)
            self.fsync(index)
            self.fetch(index)
        for index in range(len(self.brokers)):
            self.isr_update(index)
        self.advance(0.3)

    def heal(self, index: int) -> None:
        """The broker runs again: restarted if it was down, resumed if paused."""
        self.resume(index)
        self.restart(index)

    def kill(self, index: int) -> None:
        """kill -9: memory gone; the page cache (the whole log) survives."""
        broker = self.brokers[index]
        if not broker.up:
            return
        self._step_down(broker)
        broker.up = False
        self.settle()

    def power_loss(self, index: int) -> None:
        """The machine loses power: as kill -9, and the log is what was fsynced."""
        broker = self.brokers[index]
        if not broker.up:
            return
        self.kill(index)
        del broker.log[broker.synced :]

    def restart(self, index: int) -> None:
        broker = self.brokers[index]
        if broker.up:
            return
        fresh = Broker(broker.id, log=broker.log, synced=len(broker.log), epochs=broker.epochs)
        # the epoch cache names no record past the log's end (a power loss cut them)
        fresh.epochs = tuple((epoch, start) for epoch, start in broker.epochs if start < len(broker.log))
        self.brokers[index] = broker = fresh
        self._register(broker)
        self._sync(broker)
        self.settle()

    def pause(self, index: int) -> None:
        if self.brokers[index].up:
            self.brokers[index].paused = True

    def resume(self, index: int) -> None:
        self.brokers[index].paused = False
        self.settle()

    # -- the end --------------------------------------------------------------------------------------

    def converged(self) -> Broker | None:
        """The leader once it leads with every replica in its isr, all logs at its end, all committed."""
        state, _ = self.etcd.topic()
        if state.leader is None:
            return None
        leader = self.by_id(state.leader)
        progress = leader.progress
        if progress is None or progress.state.epoch != state.epoch or set(state.isr) != set(IDS):
            return None
        end = len(leader.log)
        if any(len(broker.log) != end for broker in self.brokers) or progress.high_watermark != end:
            return None
        return leader

    def finish(self, rounds: int = 100) -> tuple[Report, bool]:
        """Heal, restart everything, let a leader be elected and the followers catch up, drain: the
        checker's report, and whether the cluster converged."""
        for index, broker in enumerate(self.brokers):
            self.resume(index)
            self.restart(index)
        leader = None
        for _ in range(rounds):
            self.advance(0.5)
            for index in range(len(self.brokers)):
                self.keepalive(index)
                self.sync(index)
            for index in range(len(self.brokers)):
                self.fetch(index)
                self.fsync(index)
            for index in range(len(self.brokers)):
                self.isr_update(index)
            leader = self.converged()
            if leader is not None:
                break
        if leader is None:  # no convergence: judge what the current leader (or anyone) holds
            state, _ = self.etcd.topic()
            leader = self.by_id(state.leader) if state.leader is not None else self.brokers[0]
        hwm = leader.hwm()
        self.consume()
        delivered = [*self.delivered, *(record.decode() for record in leader.log[:hwm])]  # drain from 0
        ops = [Op(op.id, op.invoked, op.result or "info") for op in self.ops]
        logs = {broker.id: list(enumerate(broker.log)) for broker in self.brokers}
        return check(ops, delivered, logs, hwm), self.converged() is not None

    # -- for the scripted cases -----------------------------------------------------------------------

    def run(self, *steps: tuple[str, int] | str) -> None:
        """Steps by name: ("publish", 0), ("fetch", 1), "consume", ("advance", 3) (seconds)..."""
        for step in steps:
            if isinstance(step, str):
                getattr(self, step)()
            else:
                getattr(self, step[0])(step[1])

    def replicate(self, *followers: int) -> None:
        """The followers fetch twice and fsync in between: what they have is fsynced and reported."""
        for index in followers:
            self.fetch(index)
            self.fsync(index)
            self.fetch(index)

    def expire(self, *dead: int) -> None:
        """Time passes with the others keeping their leases alive, until the dead ones' expire."""
        for _ in range(int(TTL / 0.5) + 1):
            self.advance(0.5)
            for index, broker in enumerate(self.brokers):
                if index not in dead:
                    self.keepalive(index)
        assert not self.etcd.alive() & {self.brokers[index].id for index in dead}

    def leader(self) -> str | None:
        return self.etcd.topic()[0].leader

    def assert_valid(self) -> Report:
        assert self.violations() == []
        report, converged = self.finish()
        assert converged, report.summary()
        assert report.valid, report.summary()
        return report


# -- the random search --------------------------------------------------------------------------------

BROKERS = st.sampled_from(range(len(IDS)))


class ReplicationMachine(RuleBasedStateMachine):
    """Random interleavings of the steps; the invariants after each, the checker at the end."""

    world: World

    @initialize(min_isr=st.sampled_from([1, 2]))
    def start(self, min_isr: int) -> None:
        self.world = World(min_isr)

    @rule(to=st.sampled_from(["leader", *range(len(IDS))]), count=st.integers(1, 3))
    def publish(self, to: str | int, count: int) -> None:
        leader = self.world.leader()
        index = to if isinstance(to, int) else IDS.index(leader) if leader is not None else 0
        for _ in range(count):
            self.world.publish(index)

    @rule(index=BROKERS)
    def fetch(self, index: int) -> None:
        self.world.fetch(index)

    @rule(index=BROKERS)
    def fsync(self, index: int) -> None:
        self.world.fsync(index)

    @rule()
    def round(self) -> None:
        self.world.round()

    @rule(seconds=st.sampled_from([0.3, 1.0, 2.5]))
    def advance(self, seconds: float) -> None:
        self.world.advance(seconds)

    @rule(index=BROKERS)
    def keepalive(self, index: int) -> None:
        self.world.keepalive(index)

    @rule(index=BROKERS)
    def sync(self, index: int) -> None:
        self.world.sync(index)

    @rule(index=BROKERS)
    def isr_update(self, index: int) -> None:
        self.world.isr_update(index)

    @rule()
    def consume(self) -> None:
        self.world.consume()

    @rule(kind=st.sampled_from(["kill", "power_loss", "pause"]), index=BROKERS)
    def fault(self, kind: str, index: int) -> None:
        getattr(self.world, kind)(index)

    @rule(index=BROKERS)
    def heal(self, index: int) -> None:
        self.world.heal(index)

    @invariant()
    def safe(self) -> None:
        if hasattr(self, "world"):
            found = self.world.violations()
            assert not found, found

    def teardown(self) -> None:
        if hasattr(self, "world"):
            report, converged = self.world.finish()
            assert converged, report.summary()
            assert report.valid, report.summary()


SEARCH = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def test_random_histories_keep_every_ok() -> None:
    run_state_machine_as_test(ReplicationMachine, settings=SEARCH)


# -- scripted cases: the same World, step by step ---------------------------------------------------


def test_no_unclean_election_when_the_isr_shrank_to_a_lost_leader() -> None:
    """(a) The followers stop fetching, the isr shrinks to the leader, which OKs alone (min_isr 1) and is
    then lost: the followers may not lead (not in the isr), publishes are refused, and the OK'd record is
    there when the leader returns."""
    w = World(min_isr=1)
    w.round()
    w.run(("pause", 1), ("pause", 2))
    w.expire(1, 2)
    w.isr_update(0)
    assert w.etcd.topic()[0].isr == ("b0",)
    op = w.publish(0)
    w.fsync(0)
    assert op.result == "ok"
    w.power_loss(0)
    w.run(("resume", 1), ("resume", 2))
    w.expire(0)
    w.run(("sync", 1), ("sync", 2))
    state, _ = w.etcd.topic()
    assert (state.leader, state.epoch) == ("b0", 1)  # nobody took over
    assert [w.publish(1).result, w.publish(2).result, w.publish(0).result] == ["fail"] * 3
    w.restart(0)
    assert (w.leader(), w.etcd.topic()[0].epoch) == ("b0", 2)
    report = w.assert_valid()
    assert report.ok == 1


def test_kip101_a_restarted_follower_does_not_truncate_to_its_stale_hwm() -> None:
    """(b) A follower holds an OK'd record but was never told the HWM covering it (and a restart loses
    what it was told): truncating to its HWM would cut the record, and it is the only one left to lead."""
    w = World(min_isr=2)
    w.round()
    op = w.publish(0)
    w.fsync(0)
    w.replicate(1, 2)
    assert op.result == "ok"
    w.run(("kill", 1), ("restart", 1))
    follower = w.brokers[1]
    assert follower.hwm() <= op.position < len(follower.log)  # its HWM would cut the OK'd record
    w.run(("kill", 0), ("kill", 2))
    w.expire(0, 2)
    w.sync(1)
    assert w.leader() == "b1" and follower.log[op.position] == op.id.encode()
    w.assert_valid()


def double_failover(w: World) -> tuple[PubOp, PubOp]:
    """(c) KIP-279: b0 leads, b1 fetched one record more than b2; b0 dies, b1 leads epoch 2 and appends
    a record nobody fetches, dies too; b2 leads epoch 3 from a lower position than epoch 2 started."""
    w.round()
    m1 = w.publish(0)
    w.fsync(0)
    w.replicate(1, 2)
    w.publish(0)
    w.fsync(0)
    w.fetch(1)
    w.kill(0)
    w.expire(0)
    w.sync(1)
    assert w.leader() == "b1"
    w.publish(1)
    w.kill(1)
    w.expire(1)
    w.sync(2)
    assert w.leader() == "b2"
    m4 = w.publish(2)
    w.fsync(2)
    assert m4.result == "ok"
    assert w.etcd.topic()[0].epochs == ((1, 0), (2, 2), (3, 1))  # the starts go down
    return m1, m4


def test_kip279_fast_double_failover() -> None:
    w = World(min_isr=1)
    m1, m4 = double_failover(w)
    report = w.assert_valid()
    assert report.ok == 2 and {m1.id, m4.id} <= set(w.delivered)
    # b0 held the lost epoch-1 record at m4's position, b1 an epoch-2 one: both cut
    assert all(broker.log[m4.position] == m4.id.encode() for broker in w.brokers)


def test_kip279_the_next_listed_epoch_is_not_where_an_epoch_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why end_of_epoch takes the earliest later start: with the brief's first reading (the next listed
    epoch's start), b0 keeps its epoch-1 record at the position where b2 wrote epoch 3's."""

    def next_listed(self: core.TopicState, epoch: int, leader_end: int) -> int:
        return next((start for listed, start in self.epochs if listed > epoch), leader_end)

    monkeypatch.setattr(core.TopicState, "end_of_epoch", next_listed)
    monkeypatch.setattr(core.TopicState, "lineage", lambda self: self.epochs)
    w = World(min_isr=1)
    _, m4 = double_failover(w)
    report, _ = w.finish()
    assert [item.split(":")[0] for item in report.divergent] == [str(m4.position)], report.summary()


def test_an_old_leader_paused_past_its_lease_never_answers_ok() -> None:
    """(d) The leader is paused (SIGSTOP) with a publish taken just before its lease ran out; a new
    leader is elected and OKs another record at the same position; the old one wakes up: its record is
    never OK'd, it refuses new publishes, and its tail is truncated when it follows."""
    w = World(min_isr=2)
    w.round()
    m1 = w.publish(0)
    w.fsync(0)
    w.replicate(1, 2)
    w.pause(0)
    m2 = w.publish(0)  # taken: its lease is live, it does not know it is paused
    w.fsync(0)
    assert m2.result is None and w.brokers[0].log[m2.position] == m2.id.encode()
    w.expire(0)
    w.run(("sync", 1), ("sync", 2))
    assert w.leader() == "b1"
    m3 = w.publish(1)
    w.fsync(1)
    w.replicate(2)
    assert m3.result == "ok" and m3.position == m2.position
    w.resume(0)
    assert m2.result is None  # past its lease: no OK, whatever its followers say
    w.fetch(2)
    assert w.publish(0).result == "fail"
    w.keepalive(0)  # its lease is gone: it registers anew, re-reads etcd, steps down
    assert m2.result == "info"
    w.fetch(0)
    assert w.brokers[0].log[m2.position] == m3.id.encode()
    report = w.assert_valid()
    assert report.ok == 2 and m2.id not in w.delivered and {m1.id, m3.id} <= set(w.delivered)


# -- mutations: each rule skipped loses what was answered OK -------------------------------------------


def hwm_scenario(w: World) -> PubOp:
    """The leader OKs once its own fsync is done, and is lost before any follower fetched."""
    w.round()
    op = w.publish(0)
    w.fsync(0)
    w.kill(0)
    w.expire(0)
    w.sync(1)
    w.sync(2)
    return op


def fetch_epoch_scenario(w: World) -> PubOp:
    """b2 fetched an unfsynced record from b0, b0 loses power and returns as leader of epoch 2 with
    another record there; b2, still at epoch 1, fetches from it; then b0 is lost and b2 leads."""
    w.round()
    w.publish(0)
    w.fsync(0)
    w.replicate(1, 2)
    w.publish(0)
    w.fetch(2)
    w.fsync(2)
    w.kill(1)
    w.expire(1)
    w.power_loss(0)
    w.restart(0)
    assert w.etcd.topic()[0].epoch == 2 and w.brokers[2].state is not None and w.brokers[2].state.epoch == 1
    op = w.publish(0)
    w.fsync(0)
    w.replicate(2)
    w.kill(0)
    w.expire(0)
    w.sync(2)
    return op


def truncation_scenario(w: World) -> PubOp:
    """b2 holds an uncommitted record of epoch 1 that the new leader b1 never had; it fetches from b1
    (which writes another record there), then b1 is lost and b2 leads."""
    w.round()
    w.publish(0)
    w.fsync(0)
    w.replicate(1, 2)
    w.publish(0)
    w.fetch(2)
    w.kill(0)
    w.expire(0)
    w.run(("sync", 1), ("sync", 2))
    assert w.leader() == "b1"
    op = w.publish(1)
    w.fsync(1)
    w.replicate(2)
    w.kill(1)
    w.expire(1)
    w.sync(2)
    return op


def follower_fsync_scenario(w: World) -> PubOp:
    """The followers fetch and report without fsyncing, then lose power with the leader."""
    w.round()
    op = w.publish(0)
    w.fsync(0)
    w.run(("fetch", 1), ("fetch", 1), ("fetch", 2), ("fetch", 2))
    w.run(("power_loss", 1), ("power_loss", 2), ("kill", 0))
    w.expire(0, 1, 2)
    w.run(("restart", 1), ("restart", 2))
    return op


MUTATIONS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], Callable[[World], PubOp]]] = {
    "hwm is the leader's own": (
        lambda mp: mp.setattr(core.LeaderProgress, "high_watermark", property(lambda self: self._own_synced)),
        hwm_scenario,
    ),
    "no fetch epoch check": (
        lambda mp: mp.setattr(core, "check_fetch_epoch", lambda leader, follower: None),
        fetch_epoch_scenario,
    ),
    "no truncation": (
        lambda mp: mp.setattr(core, "truncation_point", lambda local, state, end, leader_end=None: end),
        truncation_scenario,
    ),
    "follower reports unfsynced": (
        lambda mp: mp.setattr(core, "follower_synced", lambda appended, synced: appended),
        follower_fsync_scenario,
    ),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_scenario_is_safe_with_the_rules(mutation: str) -> None:
    w = World(min_isr=2)
    MUTATIONS[mutation][1](w)
    w.assert_valid()


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_scenario_loses_an_ok_without_the_rule(mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    patch, scenario = MUTATIONS[mutation]
    patch(monkeypatch)
    w = World(min_isr=2)
    op = scenario(w)
    assert op.result == "ok"
    assert w.violations() != []
    report, _ = w.finish()
    assert not report.valid
    assert op.id in report.lost, report.summary()


# The random search finds these two within 300 histories (derandomized: the same histories each run with
# this hypothesis version; generation only, no shrinking: finding it is the point). The fetch epoch check
# and the follower's fsync need rarer combinations (a power loss between a follower's fetch and its fsync,
# a follower still at an old epoch): the scripted scenarios above show those.
SEARCHED = ["hwm is the leader's own", "no truncation"]


@pytest.mark.parametrize("mutation", SEARCHED)
def test_the_random_search_finds_the_mutation(mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    MUTATIONS[mutation][0](monkeypatch)
    bounded = settings(SEARCH, max_examples=300, phases=[Phase.generate], database=None, report_multiple_bugs=False)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(ReplicationMachine, settings=bounded)


# -- the rules one by one (the edges the model reaches only by chance) -----------------------------------

STATE = core.TopicState(("a", "b", "c"), "a", 1, ((1, 0),), ("a", "b", "c"), 2, "log-1")


def test_topic_state_json_round_trip_and_bad_values() -> None:
    state = attrs.evolve(STATE, epoch=3, epochs=((1, 0), (2, 5), (3, 3)), leader=None)
    assert core.TopicState.from_json(state.to_json()) == state
    good = STATE.to_json().decode()
    edits = [('"epoch":1', '"epoch":2'), ('"isr":["a","b","c"]', '"isr":["d"]'), ('"leader":"a"', '"leader":5'),
             ('"min_isr":2', '"min_isr":true'), ('"epochs":[[1,0]]', '"epochs":[]'), ('"log_id":"log-1"', '"log_id":1')]
    for bad in [b"\xff", b"[]", *(good.replace(old, new).encode() for old, new in edits)]:
        assert bad != STATE.to_json()
        with pytest.raises(ValueError):
            core.TopicState.from_json(bad)


def test_place_takes_the_least_loaded_and_a_full_isr_only_for_an_empty_log() -> None:
    alive = {"me": 9, "x": 2, "y": 1, "z": 1}
    state = core.place("me", alive, 3, 2, 0, True, "id")
    assert (state.replicas, state.isr, state.leader) == (("me", "y", "z"), ("me", "y", "z"), "me")
    assert state.epochs == ((1, 0),)
    state = core.place("me", alive, 3, 2, 40, False, "id")
    assert (state.isr, state.epochs, state.log_id) == (("me",), ((1, 40),), "id")
    assert core.place("me", {"me": 0, "x": 0}, 3, 1, 0, True, "id").replicas == ("me", "x")


def test_elect_only_from_the_isr_and_only_when_the_leader_is_gone() -> None:
    assert core.elect(STATE, "b", {"a", "b", "c"}, 7) is None  # the leader is alive
    new = core.elect(STATE, "b", {"b"}, 7)
    assert new is not None and (new.leader, new.epoch, new.epochs, new.isr) == ("b", 2, ((1, 0), (2, 7)), ("b",))
    assert core.elect(attrs.evolve(STATE, isr=("a", "c")), "b", {"b", "c"}, 7) is None  # not in the isr
    assert core.elect(STATE, "b", {"c"}, 7) is None  # not alive itself
    restarted = core.elect(STATE, "a", {"a", "b", "c"}, 3)  # a restarted leader does not resume its epoch
    assert restarted is not None and (restarted.epoch, restarted.isr) == (2, ("a", "b", "c"))


def test_truncation_point_by_epochs_never_by_hwm() -> None:
    state = attrs.evolve(STATE, epoch=3, epochs=((1, 0), (2, 5), (3, 3)))
    assert core.truncation_point([(1, 0)], state, 10) == 3  # epoch 3 started below epoch 2 (KIP-279)
    assert core.truncation_point([(1, 0), (2, 5)], state, 10) == 3
    assert core.truncation_point([(1, 0), (3, 3)], state, 10, leader_end=8) == 8
    assert core.truncation_point([(1, 0), (3, 3)], state, 6, leader_end=8) == 6
    assert core.truncation_point([(1, 0), (3, 3)], state, 6) == 6  # a candidate: no leader end to ask
    assert core.truncation_point([(4, 0)], state, 6) == 6  # this state is older than what it holds
    assert core.truncation_point([], attrs.evolve(STATE, epochs=((1, 4),)), 6) == 4
    assert state.lineage() == ((1, 0), (3, 3))
    assert core.extend_epochs([(1, 0), (2, 5)], state, 3, 9) == ((1, 0), (3, 3))


def test_fetch_epoch_check_and_follower_synced() -> None:
    assert [core.check_fetch_epoch(3, e) for e in (2, 3, 4)] == ["FENCED", None, "STALE_LEADER"]
    assert core.follower_synced(10, 4) == 4


def test_hwm_waits_for_every_isr_member_and_never_decreases() -> None:
    progress = core.LeaderProgress(STATE, "a", 0.0, 10, hwm=4)
    assert progress.high_watermark == 4  # b and c not heard from: it holds where it was
    progress.fetched("b", 10, 8, 10, 0.1)
    assert progress.high_watermark == 4
    progress.fetched("c", 9, 6, 10, 0.1)
    assert progress.high_watermark == 6 and progress.committed(6) and not progress.committed(7)
    progress.fetched("c", 3, 3, 10, 0.2)  # c truncated: the HWM does not go back
    assert progress.high_watermark == 6
    alone = core.LeaderProgress(attrs.evolve(STATE, isr=("a",), min_isr=1), "a", 0.0, 10, hwm=20)
    assert alone.high_watermark == 10  # never past its own durable tail; alone, that is the HWM


def test_isr_shrinks_after_the_lag_and_grows_when_caught_up() -> None:
    progress = core.LeaderProgress(STATE, "a", 0.0, 10)
    progress.fetched("b", 10, 10, 10, 1.0)
    assert progress.isr_change(2.5, 2.0, 10) == ("a", "b")  # c never fetched since 0.0
    assert progress.isr_change(2.5, 2.0, 10) == ("a", "b")
    assert progress.may_append() is None  # pending: min_isr counts a and b, in both isrs
    assert progress.high_watermark == 0  # pending: c still counts (and is not heard from)
    progress.applied(attrs.evolve(STATE, isr=("a", "b")))
    assert progress.high_watermark == 10
    progress.fetched("c", 4, 4, 10, 2.6)
    assert progress.isr_change(2.6, 2.0, 10) is None  # behind the HWM
    progress.fetched("c", 10, 10, 10, 2.7)
    assert progress.isr_change(2.7, 2.0, 10) == ("a", "b", "c")
    progress.applied(attrs.evolve(STATE, isr=("a",)))
    assert progress.may_append() == "NOT_ENOUGH_REPLICAS" and not progress.committed(1)
