"""ReplicaManager: cluster mode's I/O side, one per broker (issue 52; the rules are core.py's).

On when trio-nsqd is given --etcd-endpoints. The manager (owned by NSQD's nursery):
- registers the broker: a lease (--etcd-lease-ttl), `{prefix}/brokers/{id}` attached to it, kept alive
  every TTL/3. `lease_deadline` = (monotonic time the last successful keepalive was *sent*) + TTL: past
  it this broker answers no publish OK and serves no fetch (another may lead by then);
- lists `{prefix}/` (every REFRESH seconds, and at once when the watch reports a change or a CAS of ours
  went through) and reconciles: for each topic this broker is a replica of, one role task (leader.py's
  `lead` or follower.py's `follow`) under a cancel scope of its own, cancelled on a role change;
- places a topic (core.place, an etcd create) when a topic is first needed here (a PUB, /topic/create,
  a SUB) and etcd has no state for it; elects itself (core.elect, a CAS) when the leader is gone and it
  is in the isr, after truncating its log as a follower would.

Every non-ephemeral topic is replicated in cluster mode (--replicas may be 1). A topic's replication as
its Topic sees it is a TopicReplica (topic.replica: the publish gate, the high watermark its channels
are handed the log up to); a publish's answer awaits a CommitWaiter.

Callers go through core's module (`core.truncation_point(...)`): the mutation tests patch it there.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import trio

from trio_nsq.broker.replication import core
from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.files import fsync_dir, write_synced
from trio_nsq.broker.topic import ReplicationError
from trio_nsq.shared.etcd import Etcd, EtcdError, KeyValue
from trio_nsq.shared.names import is_valid_topic_name
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.broker.nsqd import NSQD
    from trio_nsq.broker.topic import Topic

log = logging.getLogger("nsqd")

# seconds between two listings of etcd when the watch says nothing (it may be broken)
REFRESH = 1.0
# a burst of changes is reconciled once
COALESCE = 0.02
# how long etcd keeps a deleted topic's tombstone (`{prefix}/deleted/{topic}`): a replica down for less
# deletes its copy when it comes back instead of placing the topic again
TOMBSTONE_TTL = 7 * 24 * 3600


class CommitWaiter:
    """What a replicated publish's answer awaits (Published.sync; ProtocolV2's pending_sync, the HTTP
    publish): OK once the records up to `end` are below the high watermark with the isr at least
    min_isr, this broker still leading the epoch it appended in, its lease live. ReplicationError
    (NOT_ENOUGH_REPLICAS_AFTER_APPEND, NOT_LEADER_AFTER_APPEND) after --replica-ack-timeout or on losing
    the lead: the message may still be delivered."""

    def __init__(self, replica: TopicReplica, end: int, epoch: int | None) -> None:
        self.replica = replica
        self.end = end
        self.epoch = epoch  # None: appended while the topic was being placed here

    async def sync(self) -> None:
        replica = self.replica
        manager = replica.manager
        timeout = manager.ack_timeout
        deadline = trio.current_time() + timeout
        if replica.role in ("leader", "placing"):
            # this broker's own fsync counts towards the HWM: a group commit now (as --sync-every=1's),
            # not a round the io loop spaces out; a failure is E_PUB_FAILED (BackendError)
            await replica.topic.group.sync()
            replica._own_durable(True)
        while True:
            # (appended while placing: only the epoch 1 of this broker's placement counts)
            if replica.role == "leader" and replica.epoch == (1 if self.epoch is None else self.epoch):
                self.epoch = replica.epoch
                progress = replica.progress
                if progress is not None and progress.committed(self.end) and manager.lease_live():
                    return
            elif replica.role != "placing":
                # (*_AFTER_APPEND: a producer tells this indeterminate refusal from admit's definite NOT_LEADER)
                raise ReplicationError("NOT_LEADER_AFTER_APPEND",
                                       "no longer leading: the publish may or may not be kept")
            if trio.current_time() >= deadline:
                if replica.role == "leader" and not manager.lease_live():
                    raise ReplicationError("NOT_LEADER_AFTER_APPEND", "lease expired")
                raise ReplicationError("NOT_ENOUGH_REPLICAS_AFTER_APPEND",
                                       f"not confirmed by {replica.min_isr()} replicas in {timeout:g}s")
            with trio.move_on_at(deadline):
                await replica.wait_changed()


class TopicReplica:
    """One topic's replication on this broker (topic.replica): its role ("none", "placing", "leader",
    "follower"), the TopicState it acts on, and on the leader its core.LeaderProgress. The Topic calls
    admit/committed_after/dispatch_limit/refuses_consumers (ReplicaGate); /replica/fetch calls fetched
    and wait_data; the manager and the role tasks change the rest, in the event loop."""

    def __init__(self, manager: ReplicaManager, topic: Topic) -> None:
        self.manager = manager
        self.topic = topic
        self.name = topic.name
        self.role = "none"
        self.state: core.TopicState | None = None
        self.rev = 0  # the state's mod_revision in etcd
        self.epoch = 0  # the epoch of the role held
        self.progress: core.LeaderProgress | None = None
        self.scope: trio.CancelScope | None = None  # the role task's
        self.busy = False  # a placement or an election under way: the manager leaves it alone
        self.placed_end = 0  # placing: the log's end when the topic was made here
        self.placed_empty = True
        self.last_hwm = 0  # the high watermark as this broker knows it (leader: progress'; follower: told)
        self.last_fetch: dict[str, float] = {}  # the leader's: each follower's last fetch (trio time)
        self.no_epochs_logged = False  # _may_lead's ERROR, once
        self._changed = trio.Event()  # HWM, isr, role or lease changed: publish waiters look again
        self._data = trio.Event()  # an append, or the HWM moved: long-polling fetches answer

    def __repr__(self) -> str:
        return f"TopicReplica({self.name} {self.role} epoch {self.epoch})"

    # --- ReplicaGate (topic.py) -------------------------------------------------------------------

    def admit(self) -> None:
        role = self.role
        if role == "leader":
            progress = self.progress
            assert progress is not None
            if not self.manager.lease_live():
                raise ReplicationError("NOT_LEADER", "lease expired")
            reason = progress.may_append()
            if reason is not None:
                raise ReplicationError(reason, f"isr {','.join(progress.state.isr)}, min_isr {progress.state.min_isr}")
        elif role != "placing":
            raise ReplicationError("NOT_LEADER", self.leader_detail())

    def committed_after(self, end: int) -> CommitWaiter:
        waiter = CommitWaiter(self, end, self.epoch if self.role == "leader" else None)
        self._notify_data()  # (the followers' long polls answer at once)
        # this broker's own fsync starts now, beside the followers' fetches, not once the publisher's task
        # is scheduled again (after the fetch answers): CommitWaiter.sync's group.sync joins this round
        self.topic.group.request_round()
        return waiter

    def dispatch_limit(self) -> int:
        log_ = self.topic.log
        assert log_ is not None
        # (a follower's channels are handed the log too, as on the leader, so that its dispatched position
        # is where a channel made after a failover starts; they deliver nothing: SUB is refused there)
        return max(log_.dispatched.position, min(self.last_hwm, log_.end_position()))

    def refuses_consumers(self) -> str | None:
        if self.role in ("leader", "placing"):
            return None
        return f"NOT_LEADER ({self.leader_detail()})"

    def stats(self) -> dict[str, Any]:
        state = self.state
        log_ = self.topic.log
        return {
            "role": self.role,
            "replicas": list(state.replicas) if state else [],
            "leader": state.leader if state else None,
            "epoch": state.epoch if state else 0,
            "isr": list(state.isr) if state else [],
            "min_isr": state.min_isr if state else 0,
            "high_watermark": self.high_watermark(),
            "log_end": log_.end_position() if log_ is not None else 0,
        }

    # --- what others ask -------------------------------------------------------------------------

    def leader_detail(self) -> str:
        state = self.state
        if state is None or state.leader is None:
            return "no leader"
        info = self.manager.brokers.get(state.leader)
        if info is None:
            return f"leader {state.leader} not alive"
        return f"leader {info.get('tcp_address', state.leader)}"

    def min_isr(self) -> int:
        return self.state.min_isr if self.state is not None else 0

    def high_watermark(self) -> int:
        if self.role == "leader" and self.progress is not None:
            return self.progress.high_watermark
        return self.last_hwm

    def fetched(self, replica: str, position: int, synced: int, log_end: int) -> None:
        """/replica/fetch: a follower's progress (the leader's)."""
        progress = self.progress
        if progress is not None:
            now = self.last_fetch[replica] = trio.current_time()
            progress.fetched(replica, position, synced, log_end, now)
            self.progress_moved()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    async def wait_data(self) -> None:
        await self._data.wait()

    # --- changes ---------------------------------------------------------------------------------

    def notify_waiters(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _notify_data(self) -> None:
        self._data.set()
        self._data = trio.Event()

    def _own_durable(self, ok: bool) -> None:
        log_ = self.topic.log
        if ok and self.progress is not None and log_ is not None:
            self.progress.own_synced(log_.durable_tail.position)
            self.progress_moved()

    def progress_moved(self) -> None:
        """The leader's progress may have a higher HWM: the channels get the log up to it, publish
        waiters and long-polling followers hear of it."""
        progress = self.progress
        if progress is None:
            return
        hwm = progress.high_watermark
        if hwm > self.last_hwm:
            self.set_hwm(hwm)
            self.notify_waiters()
            self._notify_data()

    def set_hwm(self, hwm: int) -> None:
        self.last_hwm = hwm
        log_ = self.topic.log
        if log_ is not None:
            log_.high_watermark = hwm
        self.topic.wake()  # its pump hands the channels what is below it


class ReplicaManager:
    """Cluster mode (NSQD.replication, run in NSQD's nursery). NSQD calls attach/detach as topics come
    and go; /replica/fetch and the Topics' TopicReplicas call lease_live, step_down and wake."""

    def __init__(self, nsqd: NSQD) -> None:
        opts = nsqd.options
        self.nsqd = nsqd
        self.options = opts
        self.prefix = opts.etcd_prefix.rstrip("/")
        self.me = ""  # <broadcast address>:<http port>, known once HTTP listens (run)
        self.etcd = Etcd(opts.etcd_endpoint_list, timeout=min(2.0, max(0.5, opts.etcd_lease_ttl / 3)))
        self.ttl = max(1, int(round(opts.etcd_lease_ttl)))
        self.ack_timeout = opts.replica_ack_timeout
        self.lag_time = opts.replica_lag_time
        self.lease = 0
        self.lease_deadline = -math.inf
        self.registered = False
        self.listed = False  # etcd was listed once since the broker registered
        self.states: dict[str, tuple[core.TopicState, int]] = {}  # topic -> (state, mod_revision)
        self.brokers: dict[str, dict[str, Any]] = {}  # alive broker id -> its registration
        self.replicas: dict[str, TopicReplica] = {}  # every replicated topic here
        self.known: set[str] = set()  # topics etcd listed with this broker a replica
        self.deleting: set[str] = set()  # deleted here, the etcd key not gone yet
        self.tombstones: dict[str, str] = {}  # deleted topic -> the log id it had (`{prefix}/deleted/`)
        self._bad_states: set[tuple[str, int]] = set()  # (key, revision) already logged as unreadable
        self._refresh = trio.Event()
        self._registered = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._etcd_failing = False

    # --- keys ------------------------------------------------------------------------------------

    def topic_key(self, name: str) -> str:
        return f"{self.prefix}/topics/{name}"

    def broker_key(self, broker: str) -> str:
        return f"{self.prefix}/brokers/{broker}"

    def tombstone_key(self, name: str) -> str:
        return f"{self.prefix}/deleted/{name}"

    def lease_live(self) -> bool:
        return trio.current_time() < self.lease_deadline

    def wake(self) -> None:
        """List etcd again now (a change seen, a CAS made)."""
        self._refresh.set()

    # --- life ------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        nsqd = self.nsqd
        self.me = f"{self.options.broadcast_address}:{nsqd.broadcast_http_port}"
        log.info("CLUSTER: broker %s, etcd %s (prefix %s)", self.me, ",".join(self.etcd.endpoints), self.prefix)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._run)
                # the broker says it listens once it is registered (a topic made at once is placed on
                # every broker started), or after a TTL without etcd (it keeps trying meanwhile)
                with trio.move_on_after(self.ttl):
                    await self._registered.wait()
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(1.0):
                    if self.lease:
                        try:
                            # the others see this broker gone at once, not a TTL later
                            await self.etcd.revoke(self.lease)
                        except EtcdError as exc:
                            log.warning("CLUSTER: failed to revoke the lease - %s", exc)
                with trio.move_on_after(1.0):
                    await self.etcd.aclose()

    async def _run(self) -> None:
        await self._register()
        assert self._nursery is not None
        self._nursery.start_soon(self._keepalive_loop)
        self._nursery.start_soon(self._watch_loop)
        self._nursery.start_soon(self._refresh_loop)

    async def _register(self) -> None:
        """A new lease and the broker's key on it; retried until etcd takes them."""
        opts, nsqd = self.options, self.nsqd
        info = {
            "id": self.me,
            "tcp_address": f"{opts.broadcast_address}:{nsqd.broadcast_tcp_port}",
            "http_address": f"{opts.broadcast_address}:{nsqd.broadcast_http_port}",
            "version": VERSION,
        }
        while True:
            sent = trio.current_time()
            try:
                lease = await self.etcd.grant(self.ttl)
                await self.etcd.put(self.broker_key(self.me), json.dumps(info).encode(), lease=lease)
            except EtcdError as exc:
                log.error("CLUSTER: failed to register with etcd - %s", exc)
                await trio.sleep(1.0)
                continue
            self.lease = lease
            self.lease_deadline = sent + self.ttl
            self.registered = True
            self._registered.set()
            log.info("CLUSTER: registered as %s (lease %x, ttl %ds)", self.me, lease, self.ttl)
            self.wake()
            return

    async def _keepalive_loop(self) -> None:
        failing = False
        while True:
            await trio.sleep(self.ttl / 3 if self.lease_live() else 0.25)
            sent = trio.current_time()
            try:
                remaining = await self.etcd.keepalive(self.lease)
            except EtcdError as exc:
                if not failing:  # (once per run of failures: it is retried every 0.25 s)
                    log.error("CLUSTER: lease keepalive failed - %s", exc)
                failing = True
                continue
            if failing:
                log.info("CLUSTER: lease keepalive answered again")
            failing = False
            if remaining > 0:
                self.lease_deadline = sent + self.ttl
                for replica in list(self.replicas.values()):
                    replica.notify_waiters()  # (an OK held back by a lapsed lease may go now)
                continue
            log.warning("CLUSTER: lease %x expired: registering again", self.lease)
            self.lease_deadline = -math.inf
            # another broker may lead by now: nothing led under the old lease is led on (the listing after
            # the registration decides again, a new epoch if etcd still names this broker)
            for replica in list(self.replicas.values()):
                self.step_down(replica, "its lease expired")
            await self._register()

    async def _watch_loop(self) -> None:
        """The watch only wakes the listing (which is what reconciles): a broken watch costs latency."""
        failing = False
        while True:
            try:
                _, revision = await self.etcd.get_prefix(self.prefix + "/brokers/")
                events = self.etcd.watch_prefix(self.prefix + "/", revision + 1)
                try:
                    async for _ in events:
                        failing = False
                        self.wake()
                finally:
                    await events.aclose()
            except EtcdError as exc:
                if not failing:  # (once per run of failures: the listing every REFRESH goes on meanwhile)
                    log.warning("CLUSTER: etcd watch failed - %s", exc)
                failing = True
            await trio.sleep(1.0)

    async def _refresh_loop(self) -> None:
        while True:
            self._refresh = trio.Event()
            try:
                kvs, _ = await self.etcd.get_prefix(self.prefix + "/")
            except EtcdError as exc:
                if not self._etcd_failing:
                    log.error("CLUSTER: failed to list etcd - %s", exc)
                self._etcd_failing = True
            else:
                if self._etcd_failing:
                    log.info("CLUSTER: etcd listed again")
                self._etcd_failing = False
                self._listing(kvs)
                self.listed = True
                self.reconcile()
            with trio.move_on_after(REFRESH):
                await self._refresh.wait()
            await trio.sleep(COALESCE)

    def _listing(self, kvs: list[Any]) -> None:
        brokers: dict[str, dict[str, Any]] = {}
        states: dict[str, tuple[core.TopicState, int]] = {}
        tombstones: dict[str, str] = {}
        topics_prefix, brokers_prefix = self.prefix + "/topics/", self.prefix + "/brokers/"
        deleted_prefix = self.prefix + "/deleted/"
        for kv in kvs:
            if kv.key.startswith(deleted_prefix):
                try:
                    tombstones[kv.key[len(deleted_prefix):]] = str(json.loads(kv.value)["log_id"])
                except (ValueError, KeyError, TypeError) as exc:
                    self._bad(kv.key, kv.mod_revision, exc)
            elif kv.key.startswith(brokers_prefix):
                try:
                    info = json.loads(kv.value)
                    if not isinstance(info, dict):
                        raise ValueError("not an object")
                except ValueError as exc:
                    self._bad(kv.key, kv.mod_revision, exc)
                    continue
                brokers[kv.key[len(brokers_prefix):]] = info
            elif kv.key.startswith(topics_prefix):
                if not is_valid_topic_name(kv.key[len(topics_prefix):]):
                    self._bad(kv.key, kv.mod_revision, ValueError("not a topic name"))
                    continue
                known = self.states.get(kv.key[len(topics_prefix):])
                if known is not None and known[1] == kv.mod_revision:
                    # (unchanged since the last listing: not parsed again, each second, for every topic)
                    states[kv.key[len(topics_prefix):]] = known
                    continue
                state = self._state_of(kv)
                if state is not None:
                    states[kv.key[len(topics_prefix):]] = (state, kv.mod_revision)
        gone = set(self.brokers) - set(brokers)
        came = set(brokers) - set(self.brokers)
        if gone:
            log.info("CLUSTER: brokers gone: %s", ", ".join(sorted(gone)))
        if came:
            log.info("CLUSTER: brokers alive: %s", ", ".join(sorted(came)))
        self.brokers = brokers
        self.states = states
        self.tombstones = tombstones

    def _state_of(self, kv: KeyValue) -> core.TopicState | None:
        """A topic's state as etcd holds it; None (logged once per revision) when it cannot be read."""
        try:
            return core.TopicState.from_json(kv.value)
        except ValueError as exc:
            self._bad(kv.key, kv.mod_revision, exc)
            return None

    def _bad(self, key: str, revision: int, exc: Exception) -> None:
        if (key, revision) not in self._bad_states:
            if len(self._bad_states) >= 1000:
                self._bad_states.clear()
            self._bad_states.add((key, revision))
            log.error("CLUSTER: ignoring an unreadable value of %s - %s", key, exc)

    # --- topics as NSQD makes and deletes them ----------------------------------------------------

    def attach(self, topic: Topic) -> None:
        """A topic opened here (made by a PUB, the HTTP API, a SUB, or loaded from nsqd.dat): replicated.
        Called before the lookupds are told of it."""
        if topic.ephemeral or topic.log is None:
            return  # (never replicated)
        replica = TopicReplica(self, topic)
        topic.replica = replica
        self.replicas[topic.name] = replica
        topic.keep_whole_log()  # every message through the log: none bypasses it in memory
        log_ = topic.log
        log_.high_watermark = 0  # /log/read serves nothing until the high watermark is known
        entry = self.states.get(topic.name)
        if entry is not None:
            replica.state = entry[0]
        if entry is None and self.listed and topic.name not in self.deleting and not self._tombstoned(topic):
            # first needed here: placed now (a publish meanwhile is appended and waits for the outcome)
            replica.role = "placing"
            replica.placed_end = log_.end_position()
            replica.placed_empty = log_.end_position() == log_.first_position()
            self._spawn_place(replica)
        else:
            self.wake()

    def elsewhere(self, name: str) -> str | None:
        """NSQD.topic_for_client, for a topic not here: where its leader is (the NOT_LEADER refusal's
        detail) when etcd lists it and this broker is not one of its replicas; else None (made here: a
        replica, or placed by this broker)."""
        entry = self.states.get(name)
        if entry is None or self.me in entry[0].replicas:
            return None
        leader = entry[0].leader
        if leader is None:
            return "no leader"
        info = self.brokers.get(leader)
        return f"leader {info.get('tcp_address', leader)}" if info is not None else f"leader {leader} not alive"

    def _tombstoned(self, topic: Topic) -> bool:
        """Whether etcd says this very log (by its log id) was deleted from the cluster."""
        log_ = topic.log
        return log_ is not None and log_.epoch_on_disk and self.tombstones.get(topic.name) == log_.log_id

    def detach(self, topic: Topic, deleted: bool) -> None:
        """NSQD deleted (or closes) the topic here. Deleted by /topic/delete on any of its replicas (as
        nsqd's /topic/delete, it is gone from the cluster): the etcd key goes, a tombstone naming its log
        id is left (a replica down meanwhile deletes its copy when it comes back, rather than placing the
        topic again), and the other replicas delete their copies. Deleted because etcd no longer lists it
        (reconcile): nothing more."""
        replica = self.replicas.pop(topic.name, None)
        if replica is None:
            return
        self._stop_role(replica, closing=True)
        replica.role = "none"
        if not deleted:
            return
        _remove_epochs(self.nsqd.data_path, topic.name)
        self.known.discard(topic.name)
        entry = self.states.pop(topic.name, None)
        if entry is not None and self._nursery is not None:
            state, rev = entry
            self.deleting.add(topic.name)
            self._nursery.start_soon(self._delete_key, topic.name, rev, state.log_id)

    async def _delete_key(self, name: str, rev: int, log_id: str) -> None:
        try:
            # the tombstone first: a crash between leaves a tombstone and the state, and the topic is
            # deleted again by the next /topic/delete; never the state gone without its tombstone
            lease = await self.etcd.grant(TOMBSTONE_TTL)
            await self.etcd.put(self.tombstone_key(name), json.dumps({"log_id": log_id}).encode(), lease=lease)
            if not await self.etcd.delete_if(self.topic_key(name), rev):
                log.warning("TOPIC(%s): deleted here, but its state changed in etcd meanwhile: left there", name)
            else:
                log.info("TOPIC(%s): deleted from etcd", name)
        except EtcdError as exc:
            log.error("TOPIC(%s): failed to delete its state from etcd - %s", name, exc)
        finally:
            self.deleting.discard(name)
            self.wake()

    def registers(self, topic: str) -> bool:
        """Whether the lookupds are told of this topic (and its channels) by this broker: its leader only."""
        replica = self.replicas.get(topic)
        return replica is None or replica.role == "leader"

    # --- reconciling -----------------------------------------------------------------------------

    def reconcile(self) -> None:
        """Every topic's role as etcd now says: follow, lead, elect, place, or delete."""
        if not self.registered:
            return
        alive = set(self.brokers)
        for name in list(self.known):
            if name not in self.states and name not in self.deleting:
                self.known.discard(name)
                replica = self.replicas.get(name)
                if replica is not None and not replica.busy and replica.role != "placing":
                    log.info("TOPIC(%s): deleted on its leader: deleting it here", name)
                    try:
                        self.nsqd.delete_topic(name)
                    except KeyError:
                        pass
        for name, (state, rev) in list(self.states.items()):
            if name in self.deleting:
                continue
            replica = self.replicas.get(name)
            if self.me not in state.replicas:
                if replica is not None and not replica.busy:
                    if replica.role in ("leader", "follower", "placing"):
                        self._stop_role(replica)
                    replica.state, replica.rev = state, rev
                continue
            self.known.add(name)
            if replica is None:
                self.nsqd.get_topic(name)  # (attach() makes its TopicReplica)
                replica = self.replicas.get(name)
                if replica is None:
                    continue
            if replica.busy:
                continue
            self._reconcile_topic(replica, state, rev, alive)
        for replica in list(self.replicas.values()):
            if replica.name not in self.states and replica.name not in self.deleting and not replica.busy:
                if replica.role != "placing" and self._tombstoned(replica.topic):
                    log.info("TOPIC(%s): deleted from the cluster while this broker was down: deleting it here",
                             replica.name)
                    try:
                        self.nsqd.delete_topic(replica.name)
                    except KeyError:
                        pass
                    continue
                if replica.role != "placing":
                    replica.role = "placing"
                    log_ = replica.topic.log
                    assert log_ is not None
                    replica.placed_end = log_.end_position()
                    replica.placed_empty = log_.end_position() == log_.first_position()
                self._spawn_place(replica)

    def _reconcile_topic(self, replica: TopicReplica, state: core.TopicState, rev: int, alive: set[str]) -> None:
        leader = state.leader
        if leader == self.me:
            if replica.role == "leader" and replica.epoch == state.epoch:
                if rev != replica.rev:
                    replica.state, replica.rev = state, rev
                    assert replica.progress is not None
                    replica.progress.applied(state)
                    replica.progress_moved()
                    replica.notify_waiters()
                return
            # led before a restart (or a lost track): never resumed, a new epoch is proposed
            self._spawn_elect(replica, state, rev)
            return
        if replica.role == "leader":
            self._stop_role(replica)
            log.info("TOPIC(%s): %s leads epoch %d: stepping down", replica.name, leader, state.epoch)
        if leader is None or leader not in alive:
            if replica.role == "follower":
                self._stop_role(replica)
            replica.state, replica.rev = state, rev
            if self.me in state.isr:
                self._spawn_elect(replica, state, rev)
            else:
                replica.role = "none"
            return
        if replica.role == "follower" and replica.epoch == state.epoch and replica.state is not None \
                and replica.state.leader == leader:
            replica.state, replica.rev = state, rev
            return
        self._stop_role(replica)
        self._start_follower(replica, state, rev)

    # --- roles -----------------------------------------------------------------------------------

    def _stop_role(self, replica: TopicReplica, closing: bool = False) -> None:
        was_leader = replica.role == "leader"
        if replica.scope is not None:
            replica.scope.cancel()
            replica.scope = None
        replica.role = "none"
        replica.progress = None
        replica.notify_waiters()
        replica._notify_data()
        if was_leader and not closing:
            topic = replica.topic
            self.nsqd.lookup.announce(topic, False)
            # its consumers find the new leader through the lookupds
            for channel in topic.channels.values():
                for client in list(channel.clients.values()):
                    self.nsqd.spawn(client.close)

    def step_down(self, replica: TopicReplica, why: str) -> None:
        """The leader learnt it is stale (/replica/fetch): it stops leading and reads etcd again."""
        if replica.role == "leader":
            log.warning("TOPIC(%s): stepping down from epoch %d - %s", replica.name, replica.epoch, why)
            self._stop_role(replica)
        self.wake()

    def _start_leader(self, replica: TopicReplica, state: core.TopicState, rev: int) -> None:
        self._stop_role(replica)
        topic = replica.topic
        log_ = topic.log
        assert log_ is not None and self._nursery is not None
        start = state.epochs[-1][1]
        local = [(e, s) for e, s in _read_epochs(self.nsqd.data_path, replica.name) if s < start]
        _write_epochs(self.nsqd.data_path, replica.name, [*local, (state.epoch, start)])
        progress = core.LeaderProgress(state, self.me, trio.current_time(), log_.durable_tail.position,
                                       hwm=replica.last_hwm)
        replica.role = "leader"
        replica.state, replica.rev, replica.epoch = state, rev, state.epoch
        replica.progress = progress
        replica.last_fetch = {}
        replica.last_hwm = 0
        replica.set_hwm(progress.high_watermark)
        log.info("TOPIC(%s): leading epoch %d from position %d (replicas %s, isr %s)", replica.name, state.epoch,
                 start, ",".join(state.replicas), ",".join(state.isr))
        self.nsqd.lookup.announce(topic, True)
        topic.group.when_durable(replica._own_durable)  # (what was appended while placing: fsynced now)
        replica.scope = scope = trio.CancelScope()
        self._nursery.start_soon(self._lead, replica, scope)
        replica.notify_waiters()

    def _start_follower(self, replica: TopicReplica, state: core.TopicState, rev: int) -> None:
        from trio_nsq.broker.replication.follower import follow

        assert self._nursery is not None and state.leader is not None
        replica.role = "follower"
        replica.state, replica.rev, replica.epoch = state, rev, state.epoch
        info = self.brokers.get(state.leader, {})
        address = str(info.get("http_address") or state.leader)
        log.info("TOPIC(%s): following %s (epoch %d)", replica.name, state.leader, state.epoch)
        replica.scope = scope = trio.CancelScope()
        self._nursery.start_soon(follow, self, replica, scope, address)
        replica.notify_waiters()

    def role_ended(self, replica: TopicReplica, scope: trio.CancelScope) -> None:
        """A role task ended by itself (fenced, its leader gone): the next reconcile decides again."""
        if replica.scope is scope:
            replica.scope = None
            replica.role = "none"
            replica.progress = None
            replica.notify_waiters()
        self.wake()

    async def _lead(self, replica: TopicReplica, scope: trio.CancelScope) -> None:
        """The leader's periodic work: its own durable tail into the HWM, isr changes CASed into etcd."""
        with scope:
            log_ = replica.topic.log
            assert log_ is not None
            interval = max(0.05, self.lag_time / 4)
            while True:
                await trio.sleep(interval)
                progress = replica.progress
                if progress is None:
                    return
                progress.own_synced(log_.durable_tail.position)
                replica.progress_moved()
                now = trio.current_time()
                proposal = progress.isr_change(now, self.lag_time, log_.end_position())
                if proposal is None:
                    continue
                state = replica.state
                assert state is not None
                # a replica joins only if it fetched lately: a dead one's last fetch may look caught up for
                # ever on an idle log (it would come back at once, and the isr flap)
                proposal = tuple(b for b in proposal if b in state.isr or b == self.me
                                 or now - replica.last_fetch.get(b, -math.inf) <= self.lag_time / 2)
                if set(proposal) == set(state.isr):
                    progress.applied(state)  # (the pending change dropped)
                    continue
                new = core.TopicState(state.replicas, state.leader, state.epoch, state.epochs, proposal,
                                      state.min_isr, state.log_id)
                log.info("TOPIC(%s): isr %s -> %s", replica.name, ",".join(state.isr), ",".join(proposal))
                try:
                    await self.etcd.swap(self.topic_key(replica.name), new.to_json(), replica.rev)
                except EtcdError as exc:
                    log.error("TOPIC(%s): isr change failed - %s", replica.name, exc)
                await self._reread_as_leader(replica)

    async def _reread_as_leader(self, replica: TopicReplica) -> None:
        """After a CAS of the leader's (won, lost or unknown): what etcd holds now is applied, or the
        leader steps down when it names another leader or epoch."""
        try:
            kv = await self.etcd.get(self.topic_key(replica.name))
        except EtcdError as exc:
            log.error("TOPIC(%s): cannot read its state - %s", replica.name, exc)
            if replica.progress is not None and replica.state is not None:
                replica.progress.applied(replica.state)  # (the pending change dropped: the old isr holds)
            return
        state = None if kv is None else self._state_of(kv)
        if kv is None or state is None or state.leader != self.me or state.epoch != replica.epoch:
            self.step_down(replica, "etcd names another leader or epoch")
            return
        if replica.progress is not None:
            replica.state, replica.rev = state, kv.mod_revision
            replica.progress.applied(state)
            replica.progress_moved()
            replica.notify_waiters()
        self.wake()

    async def configure(self, name: str, replicas: int | None, min_isr: int | None) -> str | None:
        """/topic/config's `replicas` and `min_isr` (on the leader; a CAS). Raised replicas: alive brokers
        holding the fewest topics join `replicas`, not the isr (they catch up, then the leader adds them);
        lowered: followers leave (the leader stays). None, or why not: NOT_LEADER, CONFLICT (etcd changed
        meanwhile, three times), ETCD_UNAVAILABLE."""
        replica = self.replicas.get(name)
        if replica is None or replica.role != "leader":
            return "NOT_LEADER"
        key = self.topic_key(name)
        for _ in range(3):
            try:
                kv = await self.etcd.get(key)
                if kv is None:
                    return "NOT_LEADER"
                state = core.TopicState.from_json(kv.value)
                if state.leader != self.me or replica.role != "leader" or state.epoch != replica.epoch:
                    return "NOT_LEADER"
                members = list(state.replicas)
                if replicas is not None and replicas > len(members):
                    loads = {b: 0 for b in self.brokers if b not in members}
                    for other, _ in self.states.values():
                        for b in other.replicas:
                            if b in loads:
                                loads[b] += 1
                    members += [b for _, b in sorted((n, b) for b, n in loads.items())][:replicas - len(members)]
                elif replicas is not None and replicas < len(members):
                    followers = [b for b in members if b != self.me]
                    keep = set(followers[:replicas - 1]) | {self.me}
                    members = [b for b in members if b in keep]
                isr = tuple(b for b in state.isr if b in members)
                new = core.TopicState(tuple(members), state.leader, state.epoch, state.epochs, isr,
                                      min_isr if min_isr is not None else state.min_isr, state.log_id)
                if new == state:
                    return None
                if await self.etcd.swap(key, new.to_json(), kv.mod_revision):
                    log.info("TOPIC(%s): replicas %s, min_isr %d", name, ",".join(new.replicas), new.min_isr)
                    await self._reread_as_leader(replica)
                    return None
            except (EtcdError, ValueError) as exc:
                log.error("TOPIC(%s): replication config failed - %s", name, exc)
                return "ETCD_UNAVAILABLE"
        return "CONFLICT"

    # --- placement and election ------------------------------------------------------------------

    def _spawn_place(self, replica: TopicReplica) -> None:
        if self._nursery is None or replica.busy or not self.registered:
            return
        replica.busy = True
        self._nursery.start_soon(self._place, replica)

    async def _place(self, replica: TopicReplica) -> None:
        """core.place + an etcd create; another broker's state wins if it was first."""
        topic = replica.topic
        log_ = topic.log
        assert log_ is not None
        key = self.topic_key(replica.name)
        try:
            if not log_.epoch_on_disk:  # (its log id is given out: on disk first)
                log_.request_meta()
                await topic.group.sync_round()
            # the brokers alive now, read fresh: the last listing may be a second old, and a topic made
            # just after a broker joined would be placed without it
            prefix = self.prefix + "/brokers/"
            loads = {kv.key[len(prefix):]: 0 for kv in (await self.etcd.get_prefix(prefix))[0]}
            loads[self.me] = 0
            for state, _ in self.states.values():
                for broker in state.replicas:
                    if broker in loads:
                        loads[broker] += 1
            state = core.place(self.me, loads, self.options.replicas, self.options.min_isr, replica.placed_end,
                               replica.placed_empty, log_.log_id)
            created = await self.etcd.create(key, state.to_json())
            kv = await self.etcd.get(key)
            if created and kv is not None and replica.role == "placing" and self.replicas.get(replica.name) is replica:
                log.info("TOPIC(%s): placed on %s", replica.name, ",".join(state.replicas))
                self.states[replica.name] = (state, kv.mod_revision)
                self.known.add(replica.name)
                self._start_leader(replica, state, kv.mod_revision)
            else:
                if replica.role == "placing":
                    replica.role = "none"
                    replica.notify_waiters()
                other = None if kv is None else self._state_of(kv)
                if kv is not None and other is not None:
                    self.states[replica.name] = (other, kv.mod_revision)  # (followed at once)
                else:
                    await trio.sleep(5.0)  # (an unreadable state: placed again later, not in a loop)
        except (EtcdError, BackendError, OSError) as exc:  # logged: the next listing tries again
            log.error("TOPIC(%s): placement failed - %s", replica.name, exc)
            if replica.role == "placing":
                replica.role = "none"
                replica.notify_waiters()
            await trio.sleep(0.5)
        finally:
            replica.busy = False
            self.wake()

    def _spawn_elect(self, replica: TopicReplica, state: core.TopicState, rev: int) -> None:
        if self._nursery is None or replica.busy or not self.lease_live():
            return
        replica.busy = True
        self._nursery.start_soon(self._elect, replica, state, rev)

    async def _elect(self, replica: TopicReplica, state: core.TopicState, rev: int) -> None:
        """Truncate as a follower would, then propose this broker as leader of epoch+1 (a CAS)."""
        won = False
        try:
            self._stop_role(replica)
            log_ = replica.topic.log
            assert log_ is not None
            if log_.log_id != state.log_id:
                if log_.end_position() != log_.first_position():
                    log.warning("TOPIC(%s): not a candidate: its log (%s) is not the topic's (%s)",
                                replica.name, log_.log_id, state.log_id)
                    return
                # in the isr and never fetched: nothing to hold, the topic's log starts where epoch 1 did
                _write_epochs(self.nsqd.data_path, replica.name, [])
                await log_.reset(state.epochs[0][1], state.log_id)
            if not self._may_lead(replica, state):
                if state.leader == self.me:  # (restarted: the others wait for a leader etcd says is alive)
                    await self._give_up_lead(replica, state, rev)
                return
            await truncate(self.nsqd.data_path, replica, state, None)
            new = core.elect(state, self.me, set(self.brokers) | {self.me}, log_.end_position())
            if new is None:
                return
            log.info("TOPIC(%s): proposing itself as leader of epoch %d at position %d", replica.name, new.epoch,
                     log_.end_position())
            key = self.topic_key(replica.name)
            try:
                await self.etcd.swap(key, new.to_json(), rev)
            except EtcdError as exc:
                log.error("TOPIC(%s): election failed - %s", replica.name, exc)
            kv = await self.etcd.get(key)
            if kv is None:
                return
            now = self._state_of(kv)
            if now is None:
                return
            if now == new and self.replicas.get(replica.name) is replica:
                self.states[replica.name] = (now, kv.mod_revision)
                self._start_leader(replica, now, kv.mod_revision)
                won = True
        except EtcdError as exc:
            log.error("TOPIC(%s): election failed - %s", replica.name, exc)
            await trio.sleep(0.2)
        finally:
            replica.busy = False
            if won:  # (else the next listing, or the watch seeing the winner's CAS, decides again: no loop)
                self.wake()

    def _may_lead(self, replica: TopicReplica, state: core.TopicState) -> bool:
        """Whether this replica may be a candidate. Its log is cut by its epoch cache before it leads: one
        missing or unreadable, its records past the first listed epoch's start would all go (an empty log
        leading, what was committed lost). Such a replica only follows (a live leader's end bounds the
        cut: safe, and the cache is written again) and logs one ERROR."""
        log_ = replica.topic.log
        assert log_ is not None
        first = max(state.epochs[0][1] if state.epochs else 0, log_.first_position())
        if log_.end_position() <= first or _epochs_readable(self.nsqd.data_path, replica.name):
            replica.no_epochs_logged = False  # (one ERROR a time it happens)
            return True
        if not replica.no_epochs_logged:
            replica.no_epochs_logged = True
            log.error("TOPIC(%s): not a candidate for leader: its log ends at %d and its epoch cache %s is "
                      "missing or unreadable; it follows the next leader", replica.name, log_.end_position(),
                      _epochs_path(self.nsqd.data_path, replica.name))
        return False

    async def _give_up_lead(self, replica: TopicReplica, state: core.TopicState, rev: int) -> None:
        """etcd names this broker leader (before a restart) and it may not lead: no leader, and not in the
        isr if another is (a CAS), so the other in-sync replicas elect one."""
        isr = tuple(b for b in state.isr if b != self.me) or state.isr
        new = core.TopicState(state.replicas, None, state.epoch, state.epochs, isr, state.min_isr, state.log_id)
        if await self.etcd.swap(self.topic_key(replica.name), new.to_json(), rev):
            log.warning("TOPIC(%s): gave up leading epoch %d (isr %s)", replica.name, state.epoch, ",".join(isr))


# --- the epoch cache: `<data>/<topic>.replica.dat` ---------------------------------------------------


def _epochs_path(data_path: str, topic: str) -> str:
    return os.path.join(data_path, f"{topic}.replica.dat")


def _read_epochs(data_path: str, topic: str) -> list[tuple[int, int]]:
    """The (epoch, start position) of the records this replica holds (KIP-101's leader epoch cache)."""
    try:
        with open(_epochs_path(data_path, topic), "rb") as fh:
            value = json.loads(fh.read())
        return [(int(e), int(s)) for e, s in value["epochs"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("TOPIC(%s): unreadable %s - %s: taken as empty", topic, _epochs_path(data_path, topic), exc)
        return []


def _epochs_readable(data_path: str, topic: str) -> bool:
    """Whether the epoch cache is there, readable, and names an epoch."""
    try:
        with open(_epochs_path(data_path, topic), "rb") as fh:
            value = json.loads(fh.read())
        return len([(int(e), int(s)) for e, s in value["epochs"]]) > 0
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_epochs(data_path: str, topic: str, epochs: list[tuple[int, int]]) -> None:
    """Written to a temp file, fsynced and renamed: a crash leaves the old cache or the new."""
    path = _epochs_path(data_path, topic)
    tmp = path + ".tmp"
    write_synced(tmp, json.dumps({"epochs": [[e, s] for e, s in epochs]}).encode())
    os.rename(tmp, path)
    fsync_dir(data_path)


def _remove_epochs(data_path: str, topic: str) -> None:
    try:
        os.remove(_epochs_path(data_path, topic))
    except OSError:
        pass


async def truncate(data_path: str, replica: TopicReplica, state: core.TopicState,
                   leader_end: int | None) -> list[tuple[int, int]]:
    """KIP-101/279: the log cut where core.truncation_point says (the epoch cache with it, first: a crash
    between leaves a cache naming no record past the cut). The epoch cache after it."""
    log_ = replica.topic.log
    assert log_ is not None
    local = _read_epochs(data_path, replica.name)
    end = log_.end_position()
    point = core.truncation_point(local, state, end, leader_end)
    if point < end:
        log.warning("TOPIC(%s): truncating its log from %d to %d (epoch %d, leader epoch %d)", replica.name,
                    end, point, local[-1][0] if local else 0, state.epoch)
        local = [(e, s) for e, s in local if s < point]
        _write_epochs(data_path, replica.name, local)
        await log_.truncate(point)  # (after the sync round in flight, if any)
    return local
