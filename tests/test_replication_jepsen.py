"""Replication tested the way Jepsen tests (issue 52): etcd + nsqlookupd + 3 trio-nsqd, real processes.

Producers (threads: two PUB over TCP, one /pub over HTTP, one MPUB of 20) publish unique ids to whoever
etcd names leader (in the main runs one of the TCP ones, "l1", finds the leader as an NSQ client does,
through nsqlookupd's /lookup), and log every op as the checker wants it: "ok" (answered OK), "fail"
(definitely not appended: refused before the append, or no connection at all), "info" (unknown: a timeout,
a connection lost, a refusal after the append); a consumer follows the leader too and FINs what it gets,
so the channel's cursor moves and must survive each failover. Meanwhile nemeses hit the leader in turn:
kill -9 (then a restart), SIGSTOP past its lease (then SIGCONT), a partition from etcd and from its
followers (tests/net_proxy.py; then heal), a power loss (tests/power_loss.py through
tests/cluster_node.py: only what was fsynced survives; then a restart). That is the fixed run; the random
run draws its schedule as Jepsen does, from a seeded random.Random (JEPSEN_SEED replays one; the seed is
printed): 6-8 faults, one at a time, of those four on the leader and two on a follower (kill -9 then a
restart, SIGSTOP shorter than the lease), with random durations and gaps of 0.5-3 s. The first broker's
disk is slow (its segment fsyncs wait 0.2 s), so when it leads its followers hold records it has not
fsynced. After each nemesis every replica's log is read as it is served (a snapshot: below the lowest
served end all must agree). Then everything heals, the topic gets one leader and a full isr again, every
replica's log is read back through `/log/read` (the same positions everywhere below the high watermark),
the channel made before the first publish is drained on the leader, and tests/replication_checker.py
judges: lost 0 (every OK delivered), unexpected 0, divergent 0; duplicates are counted and printed (at
least once is NSQ's promise).

The checker is proven by mutations (tests/cluster_node.py --mutation): each breaks one rule of
trio_nsq/broker/replication/core.py in every broker, and a short scripted nemesis that provokes exactly
that bug must make the checker say INVALID. Each scenario is also run without the mutation, where it must
say valid: the failure comes from the mutation, not from the scenario.

The harness's own parts (the proxy, the power-loss wrapper, the mutation flag, the nemeses, the reading
of refusals) are tested first, on plain brokers, so a failure of the big test is the broker's and not
the harness's.

Timings (2 shared cores): the fixed run ~40 s, the random one 40-55 s, each scenario 12-20 s, the file
~220 s.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from cluster import Cluster, Node
from net_proxy import Proxy
from nsq_raw import ConnectionClosed, Error, FrameTimeout, Message, RawNSQ, Response, encode_mpub_body
from processes import BrokerProcess, wait_for
from replication_checker import Op, Report, check

TOPIC = "jepsen"
CHANNEL = "drain"
ACK_TIMEOUT = 3.0  # --replica-ack-timeout: an op waits at most this (plus slack) for its answer
OP_TIMEOUT = ACK_TIMEOUT + 2.0
QUIET = 3.0  # the drain ends after this long without a message
_RECORD = struct.Struct(">iqH16s")  # [size][timestamp ns][attempts][id] then the body

pytestmark = pytest.mark.cluster


# --- the history -------------------------------------------------------------------------------------

class History:
    """Every op of every producer, as (id, invoked, result, detail); appended from the producer threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[tuple[str, float, str, str]] = []
        # logs read back mid-run (snapshot()): (label, replica -> records, the end all of them served)
        self.snapshots: list[tuple[str, dict[str, list[tuple[int, bytes]]], int]] = []

    def add(self, op_id: str, invoked: float, result: str, detail: str = "") -> None:
        with self.lock:
            self.records.append((op_id, invoked, result, detail))

    def ops(self) -> list[Op]:
        with self.lock:
            return [Op(op_id, invoked, result) for op_id, invoked, result, _ in self.records]

    def ok_ids(self) -> list[str]:
        with self.lock:
            return [op_id for op_id, _, result, _ in self.records if result == "ok"]

    def details(self) -> dict[str, int]:
        """How many ops ended each way (result: detail), for the printed summary."""
        counts: dict[str, int] = {}
        with self.lock:
            for _, _, result, detail in self.records:
                key = f"{result}:{detail}" if detail else result
                counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items()))


def classify_refusal(text: str) -> tuple[str, str]:
    """An error answer's (result, detail). The refusals after the append say so (`*_AFTER_APPEND`):
    "info", the message may or may not be delivered; the other NOT_ENOUGH_REPLICAS / NOT_LEADER (over TCP
    or HTTP) were refused before the append: "fail" (definite). Anything else is "info"."""
    for code in ("NOT_ENOUGH_REPLICAS_AFTER_APPEND", "NOT_LEADER_AFTER_APPEND"):
        if code in text:
            return "info", code
    for code in ("NOT_ENOUGH_REPLICAS", "NOT_LEADER"):
        if code in text:
            return "fail", code
    return "info", text.split(" ", 1)[0][:40]


def body_of(op_id: str) -> bytes:
    return op_id.encode()


# --- producers ---------------------------------------------------------------------------------------

class Producer(threading.Thread):
    """Publishes `prefix-<n>` ids one at a time to the leader etcd names (over TCP or HTTP) until stopped.
    Follows the leader: reads etcd again after any op not answered OK, and every second."""

    def __init__(self, cluster: Cluster, history: History, prefix: str, kind: str,
                 stop: threading.Event, pause: float = 0.005, limit: int | None = None, batch: int = 1) -> None:
        super().__init__(name=f"producer-{prefix}", daemon=True)
        self.cluster = cluster
        self.history = history
        self.prefix = prefix
        self.kind = kind
        self.stop_event = stop
        self.pause = pause
        self.limit = limit
        self.batch = batch  # kind "mpub": ids per MPUB (one op each, all with the MPUB's answer)
        self.sent = 0
        self.error: BaseException | None = None
        self._node: Node | None = None
        self._looked_up = 0.0
        self._conn: RawNSQ | None = None
        self._http = httpx.Client(timeout=OP_TIMEOUT)
        self._etcd = httpx.Client(base_url=cluster.etcd.endpoint, timeout=2.0)

    def leader(self, refresh: bool) -> Node | None:
        if refresh or self._node is None or time.monotonic() - self._looked_up > 1.0:
            node = self.find_leader(refresh)
            self._looked_up = time.monotonic()
            if node is not self._node:
                self._drop_conn()
            self._node = node
        return self._node

    def find_leader(self, after_failure: bool) -> Node | None:
        """The node etcd names leader (None: none named, or etcd unreachable)."""
        try:
            state = self.cluster.state(TOPIC, client=self._etcd)
        except httpx.HTTPError:
            return None
        return None if state is None else self.cluster.node(state.get("leader"))

    def close_clients(self) -> None:
        self._http.close()
        self._etcd.close()

    def _drop_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def run(self) -> None:
        try:
            refresh = True
            while not self.stop_event.is_set() and (self.limit is None or self.sent < self.limit):
                node = self.leader(refresh)
                if node is None:
                    time.sleep(0.1)
                    refresh = True
                    continue
                count = self.batch if self.kind == "mpub" else 1
                op_ids = [f"{self.prefix}-{self.sent + n:07d}" for n in range(count)]
                self.sent += count
                invoked = time.monotonic()
                if self.kind == "http":
                    result, detail = self.publish_http(node, op_ids[0])
                else:
                    result, detail = self.publish_tcp(node, op_ids)
                for op_id in op_ids:
                    self.history.add(op_id, invoked, result, detail)
                refresh = result != "ok"
                if refresh:
                    time.sleep(0.05)  # a leader change takes a lease's time: do not spin on refusals
                elif self.pause:
                    time.sleep(self.pause)
        except BaseException as exc:  # noqa: BLE001 - reported by the test, which joins us
            self.error = exc
        finally:
            self._drop_conn()
            self.close_clients()

    def publish_tcp(self, node: Node, op_ids: list[str]) -> tuple[str, str]:
        if self._conn is None:
            try:
                self._conn = RawNSQ(node.tcp_address, timeout=OP_TIMEOUT)
            except OSError:
                return "fail", "connect"  # nothing sent
        conn = self._conn
        try:
            if self.kind == "mpub":
                conn.command("MPUB", TOPIC, body=encode_mpub_body([body_of(op_id) for op_id in op_ids]))
            else:
                conn.command("PUB", TOPIC, body=body_of(op_ids[0]))
            frame = conn.next_frame(OP_TIMEOUT)
        except FrameTimeout:
            self._drop_conn()
            return "info", "timeout"
        except (ConnectionClosed, OSError):
            self._drop_conn()
            return "info", "connection lost"
        if isinstance(frame, Response) and frame.data == b"OK":
            return "ok", ""
        self._drop_conn()  # an error frame may close the connection (E_PUB_FAILED is fatal in nsqd)
        if isinstance(frame, Error):
            return classify_refusal(frame.text)
        return "info", f"unexpected frame {frame!r}"[:60]

    def publish_http(self, node: Node, op_id: str) -> tuple[str, str]:
        try:
            reply = self._http.post(f"{node.http_url}/pub", params={"topic": TOPIC}, content=body_of(op_id))
        except httpx.ConnectError:
            return "fail", "connect"
        except httpx.HTTPError as exc:
            return "info", type(exc).__name__
        if reply.status_code == 200 and reply.text.strip() == "OK":
            return "ok", ""
        try:
            message = str(reply.json().get("message", ""))
        except ValueError:
            message = reply.text[:60]
        if reply.status_code == 503:
            return classify_refusal(message)
        return "info", f"{reply.status_code} {message}"[:60]


class LookupdProducer(Producer):
    """A producer that finds the leader as an NSQ client does, through nsqlookupd's `/lookup?topic=`
    rather than etcd: the brokers it lists (a broker registers a topic it leads and unregisters one it
    stops leading, so usually the leader alone; but a leader paused or partitioned from etcd stays
    listed, beside its successor, until it notices), mapped to nodes by the broker id they advertise
    (`<broadcast_address>:<http_port>`). With several listed it takes them in turn, moving on after an op
    not answered OK ("publish through a list of brokers and move to the next on an error",
    docs/cluster.md); none listed (404 TOPIC_NOT_FOUND, between an unregistration and the next leader's
    registration): it waits and asks again."""

    def __init__(self, cluster: Cluster, history: History, prefix: str, kind: str, stop: threading.Event,
                 **kwargs: Any) -> None:
        super().__init__(cluster, history, prefix, kind, stop, **kwargs)
        self._lookupd = httpx.Client(base_url=cluster.lookupd.http_url, timeout=2.0)
        self._turn = 0
        self.lookups = 0
        self.listed_several = 0  # lookups that listed more than one broker (an old leader not yet gone)

    def find_leader(self, after_failure: bool) -> Node | None:
        self.lookups += 1
        try:
            reply = self._lookupd.get("/lookup", params={"topic": TOPIC})
            listed = (reply.json().get("producers") or []) if reply.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return None
        nodes = [node for node in (self.cluster.node(f"{p.get('broadcast_address')}:{p.get('http_port')}")
                                   for p in listed) if node is not None]
        if not nodes:
            return None
        if len(nodes) > 1:
            self.listed_several += 1
        if after_failure:
            self._turn += 1
        return nodes[self._turn % len(nodes)]

    def close_clients(self) -> None:
        super().close_clients()
        self._lookupd.close()


class LiveConsumer(threading.Thread):
    """Consumes the channel on whoever etcd names leader while the nemeses run, FINning each message:
    the channel's cursor moves and replicates, so a failover must hand the new leader a cursor that
    misses nothing (redelivery is allowed: duplicates). Reconnects whenever its connection ends (a
    broker that stops leading closes its consumers' connections) or the leader changes."""

    def __init__(self, cluster: Cluster, stop: threading.Event) -> None:
        super().__init__(name="consumer", daemon=True)
        self.cluster = cluster
        self.stop_event = stop
        self.delivered: list[str] = []
        self.connections = 0
        self.error: BaseException | None = None
        self._etcd = httpx.Client(base_url=cluster.etcd.endpoint, timeout=2.0)

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                try:
                    state = self.cluster.state(TOPIC, client=self._etcd)
                except httpx.HTTPError:
                    state = None
                node = None if state is None else self.cluster.node(state.get("leader"))
                if node is None:
                    time.sleep(0.2)
                    continue
                self.consume(node)
        except BaseException as exc:  # noqa: BLE001 - reported by the test, which joins us
            self.error = exc
        finally:
            self._etcd.close()

    def consume(self, node: Node) -> None:
        try:
            conn = RawNSQ(node.tcp_address, timeout=2.0)
        except OSError:
            time.sleep(0.2)
            return
        self.connections += 1
        with conn:
            try:
                conn.sub(TOPIC, CHANNEL)
                conn.rdy(100)
                checked = time.monotonic()
                while not self.stop_event.is_set():
                    if not self.take(conn, 1.0):
                        return  # E_SUB_FAILED on a follower, or the like: look the leader up again
                    if time.monotonic() - checked > 1.0:
                        checked = time.monotonic()
                        if self.cluster.node((self.cluster.state(TOPIC, client=self._etcd) or {}).get("leader")) \
                                is not node:
                            return
                # stopping: nothing more sent, what is on the wire FINned (a message in flight when the
                # connection closes waits for --msg-timeout before it is delivered again, as in nsqd)
                conn.rdy(0)
                until = time.monotonic() + 1.0
                while time.monotonic() < until and self.take(conn, 0.2):
                    pass
            except (ConnectionClosed, OSError, AssertionError, httpx.HTTPError):
                time.sleep(0.2)  # closed by a broker that stopped leading, or refused: look again

    def take(self, conn: RawNSQ, timeout: float) -> bool:
        """One frame: a message is kept and FINned. False on an error frame."""
        try:
            frame = conn.next_frame(timeout)
        except FrameTimeout:
            return True
        if isinstance(frame, Message):
            self.delivered.append(frame.body.decode(errors="replace"))
            conn.fin(frame.id)
        return not isinstance(frame, Error)


# --- reading back: the replicas' logs and the channel ------------------------------------------------

def positions(node: Node, topic: str = TOPIC) -> dict[str, Any] | None:
    try:
        reply = node.http.get("/log/positions", params={"topic": topic})
    except httpx.HTTPError:
        return None
    return reply.json() if reply.status_code == 200 else None


def read_log(node: Node, upto: int, topic: str = TOPIC) -> list[tuple[int, bytes]]:
    """Every record of `node`'s log from its first up to `upto`, as (position, raw record)."""
    first = positions(node, topic)
    assert first is not None, f"{node.name} has no log of {topic}"
    position = first["first"]
    records: list[tuple[int, bytes]] = []
    while position < upto:
        reply = node.http.get("/log/read", params={"topic": topic, "position": position, "end": upto})
        assert reply.status_code == 200, f"{node.name} /log/read at {position}: {reply.status_code} {reply.text}"
        count = int(reply.headers["X-NSQ-Records"])
        size = int(reply.headers["X-NSQ-Records-Bytes"])
        start = int(reply.headers["X-NSQ-Position"])
        data = reply.content[:size]
        offset = 0
        for _ in range(count):
            (length,) = struct.unpack_from(">i", data, offset)
            records.append((start + offset, data[offset:offset + 4 + length]))
            offset += 4 + length
        nxt = int(reply.headers["X-NSQ-Next-Position"])
        assert nxt > position, f"{node.name} /log/read made no progress at {position}"
        position = nxt
    return records


def body_of_record(record: bytes) -> str:
    return record[_RECORD.size:].decode(errors="replace")


def quiesce(cluster: Cluster, timeout: float = 45.0) -> tuple[Node, int]:
    """After the heal: one leader with every replica in its isr, and every replica's log served up to
    the same end, twice in a row a second apart. Returns the leader and that end (the high watermark)."""
    leader = cluster.wait_for_leader(TOPIC, timeout=timeout, isr=len(cluster.nodes))
    last: list[int | None] = []

    def settled() -> int | None:
        nonlocal last
        ends = [(positions(node) or {}).get("end") for node in cluster.nodes]
        stable = ends == last and None not in ends and len(set(ends)) == 1
        last = ends
        return ends[0] if stable else None

    end = wait_for(settled, timeout=timeout, interval=1.0, message="every replica's log at the same end")
    leader = cluster.wait_for_leader(TOPIC, timeout=5, isr=len(cluster.nodes))
    return leader, int(end)


def channel_backlog(node: Node) -> int:
    """What the channel on `node` still holds: queued, in flight (a consumer's, gone: --msg-timeout
    gives it back) and deferred."""
    stats = node.http.get("/stats", params={"format": "json", "topic": TOPIC, "channel": CHANNEL}).json()
    for topic in stats.get("topics") or []:
        for channel in topic.get("channels") or []:
            if topic["topic_name"] == TOPIC and channel["channel_name"] == CHANNEL:
                return int(channel["depth"]) + int(channel["in_flight_count"]) + int(channel["deferred_count"])
    return 0


def drain(node: Node, limit: float = 60.0) -> list[str]:
    """SUB to the channel on `node`, FIN everything until QUIET seconds pass without a message and the
    channel holds nothing more (not even in flight with a consumer that went away)."""
    delivered: list[str] = []
    deadline = time.monotonic() + limit
    with RawNSQ(node.tcp_address, timeout=QUIET) as conn:
        conn.sub(TOPIC, CHANNEL)
        conn.rdy(500)
        while time.monotonic() < deadline:
            try:
                frame = conn.next_frame(QUIET)
            except FrameTimeout:
                if channel_backlog(node) == 0:
                    return delivered
                continue
            if isinstance(frame, Message):
                delivered.append(frame.body.decode(errors="replace"))
                conn.fin(frame.id)
            elif isinstance(frame, Error):
                raise AssertionError(f"drain on {node.name}: {frame.text}")
    raise AssertionError(f"drain on {node.name} still receiving after {limit}s")


def snapshot(cluster: Cluster, history: History, label: str) -> None:
    """Read every running replica's log now, each up to the end it serves (`/log/read` stops at its
    high watermark): below the lowest of those ends every replica serves the same records, whatever
    happens later. (A follower holding records of an old epoch below the high watermark it serves is
    wrong even if a later truncation repairs it: a positional reader may have read them meanwhile.)"""
    ends: dict[str, tuple[Node, int]] = {}
    for node in cluster.nodes:
        if node.is_alive() and not node.stopped:
            found = positions(node)
            if found is not None:
                ends[node.name] = (node, int(found["end"]))
    if len(ends) < 2:
        return
    logs = {name: read_log(node, end) for name, (node, end) in ends.items()}
    common = min(end for _, end in ends.values())
    history.snapshots.append((label, logs, common))
    cluster.note(f"snapshot {label}: served ends {[end for _, end in ends.values()]}")


def judge(cluster: Cluster, history: History, label: str, settle: bool = True,
          consumed: Sequence[str] = ()) -> Report:
    """Heal everything, wait for the cluster to settle, read the replicas' logs, drain, check. With
    `settle` off (a mutated cluster may never settle: a replica whose tail diverged cannot follow), after
    a while the logs are read as they are, each up to the leader's end or its own: what a replica lacks
    below the leader's high watermark counts as divergent."""
    started = time.monotonic()
    cluster.heal_all()
    try:
        leader, hwm = quiesce(cluster, timeout=45.0 if settle else 15.0)
    except AssertionError as exc:
        if settle:
            raise
        print(f"[{label}] the cluster did not settle: {exc}")
        leader = cluster.wait_for_leader(TOPIC)
        hwm = (positions(leader) or {})["end"]
    ends = {node.name: (positions(node) or {}).get("end", 0) for node in cluster.nodes}
    logs = {node.name: read_log(node, min(hwm, ends[node.name])) for node in cluster.nodes}
    delivered = [*consumed, *drain(leader)]
    report = check(history.ops(), delivered, logs, hwm)
    for name, mid_logs, common in history.snapshots:  # divergences seen mid-run count as well
        mid = check([], [], mid_logs, common)
        report = attrs.evolve(report, divergent=report.divergent + [f"({name}) {d}" for d in mid.divergent])
    state = cluster.state(TOPIC)
    print(f"\n[{label}] {report.summary()}")
    print(f"[{label}] ops by outcome: {history.details()}")
    print(f"[{label}] delivered {len(delivered)} ({len(set(delivered))} distinct); high watermark {hwm}; "
          f"records per replica {[len(records) for records in logs.values()]}; final state: {state}; "
          f"settle+read+drain {time.monotonic() - started:.1f}s")
    return report


# --- setting a run up ----------------------------------------------------------------------------------

def make_topic(cluster: Cluster) -> Node:
    """The topic, created on the first broker (placement: all three replicas, an empty log: a full isr),
    and its channel, before any publish, on every replica."""
    first = cluster.nodes[0]
    reply = first.http.post("/topic/create", params={"topic": TOPIC})
    assert reply.status_code == 200, reply.text
    leader = cluster.wait_for_leader(TOPIC, isr=len(cluster.nodes))
    reply = leader.http.post("/channel/create", params={"topic": TOPIC, "channel": CHANNEL})
    assert reply.status_code == 200, reply.text

    def everywhere() -> bool:
        for node in cluster.nodes:
            stats = node.http.get("/stats", params={"format": "json", "topic": TOPIC}).json()
            topics = [t for t in stats.get("topics") or [] if t["topic_name"] == TOPIC]
            if not topics or CHANNEL not in [c["channel_name"] for c in topics[0].get("channels") or []]:
                return False
        return True

    wait_for(everywhere, timeout=15, interval=0.2, message="the channel on every replica")
    return leader


def start_producers(cluster: Cluster, history: History, stop: threading.Event, mpub: int = 0,
                    lookupd: bool = False, **kwargs: Any) -> list[Producer]:
    """Two TCP producers (PUB), one HTTP (/pub), and with `mpub` one more MPUBing that many at a time.
    With `lookupd` the second TCP one ("l1") finds the leader through nsqlookupd (LookupdProducer), the
    others through etcd. Their ids are all of one length: records of one size (see scenario_divergent_tail)."""
    second = LookupdProducer(cluster, history, "l1", "tcp", stop, **kwargs) if lookupd \
        else Producer(cluster, history, "t2", "tcp", stop, **kwargs)
    producers = [Producer(cluster, history, "t1", "tcp", stop, **kwargs),
                 second,
                 Producer(cluster, history, "h1", "http", stop, **kwargs)]
    if mpub:
        producers.append(Producer(cluster, history, "m1", "mpub", stop, batch=mpub, **kwargs))
    for producer in producers:
        producer.start()
    return producers


def stop_producers(producers: list[Producer], stop: threading.Event) -> None:
    stop.set()
    for producer in producers:
        producer.join(OP_TIMEOUT + 5)
        assert not producer.is_alive(), f"{producer.name} did not stop"
        assert producer.error is None, f"{producer.name} failed: {producer.error!r}"


def new_cluster(tmp_path: Path, mutation: str | None = None,
                fsync_delay: float | Sequence[float] = 0.0) -> Cluster:
    # --msg-timeout: a message in flight with a consumer that went away comes back this soon
    return Cluster(tmp_path, mutation=mutation, fsync_delay=fsync_delay, replica_ack_timeout=f"{ACK_TIMEOUT:g}s",
                   msg_timeout="5s")


# --- the harness's own parts -----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("E_PUB_FAILED PUB failed: NOT_LEADER (leader 127.0.0.1:4150)", ("fail", "NOT_LEADER")),
    ("E_PUB_FAILED PUB failed: NOT_LEADER (no leader)", ("fail", "NOT_LEADER")),
    ("E_PUB_FAILED PUB failed: NOT_LEADER_AFTER_APPEND (no longer leading: the publish may or may not be kept)",
     ("info", "NOT_LEADER_AFTER_APPEND")),
    ("E_PUB_FAILED PUB failed: NOT_LEADER_AFTER_APPEND (lease expired)", ("info", "NOT_LEADER_AFTER_APPEND")),
    ("E_PUB_FAILED PUB failed: NOT_LEADER (lease expired)", ("fail", "NOT_LEADER")),  # (admit's: before)
    ("NOT_LEADER", ("fail", "NOT_LEADER")),  # HTTP's 503 before the append
    ("NOT_LEADER_AFTER_APPEND", ("info", "NOT_LEADER_AFTER_APPEND")),
    ("E_PUB_FAILED PUB failed: NOT_ENOUGH_REPLICAS (isr a, min_isr 2)", ("fail", "NOT_ENOUGH_REPLICAS")),
    ("NOT_ENOUGH_REPLICAS_AFTER_APPEND", ("info", "NOT_ENOUGH_REPLICAS_AFTER_APPEND")),
    ("E_PUB_FAILED PUB failed exiting", ("info", "E_PUB_FAILED")),
])
def test_only_refusals_before_the_append_count_as_fail(text, expected):
    assert classify_refusal(text) == expected


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                if server.fileno() == -1:
                    return
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return server, thread


def _round_trip(sock: socket.socket, data: bytes, timeout: float = 1.0) -> bytes:
    sock.settimeout(timeout)
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionResetError("closed")
        got += chunk
    return got


def test_proxy_relays_drops_while_cut_and_heals():
    server, _ = _echo_server()
    with Proxy(server.getsockname()) as proxy:
        before = socket.create_connection(("127.0.0.1", proxy.port))
        assert _round_trip(before, b"hello") == b"hello"

        proxy.cut()
        with pytest.raises(TimeoutError):  # the open connection goes silent: bytes are dropped, no RST
            _round_trip(before, b"lost", timeout=0.5)
        during = socket.create_connection(("127.0.0.1", proxy.port))  # accepted, and then silence
        with pytest.raises(TimeoutError):
            _round_trip(during, b"lost too", timeout=0.5)

        proxy.heal()
        for silenced in (before, during):  # reset at the heal: what they sent is gone, they must reconnect
            silenced.settimeout(2)
            with pytest.raises(OSError):
                _round_trip(silenced, b"x", timeout=2)
        after = socket.create_connection(("127.0.0.1", proxy.port))
        assert _round_trip(after, b"again") == b"again"

        proxy.cut(reset=True)
        with pytest.raises(OSError):  # reset at once, not a silence
            _round_trip(after, b"x", timeout=2)
        refused = socket.create_connection(("127.0.0.1", proxy.port))
        with pytest.raises(OSError):
            _round_trip(refused, b"x", timeout=2)
        proxy.heal()
        assert _round_trip(socket.create_connection(("127.0.0.1", proxy.port)), b"ok") == b"ok"
        assert proxy.relayed > 0
    server.close()


class WrappedBroker(BrokerProcess):
    """A plain broker (no etcd) through tests/cluster_node.py, to test the wrapper itself."""

    def __init__(self, base_dir: Path, *extra: str, **flags: object) -> None:
        super().__init__(base_dir, env=None, **flags)
        self.extra = list(extra)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.cluster_node", f"--data-path={self.data_path}", *self.extra, "--"]


def _depth(broker: BrokerProcess, topic: str) -> int:
    stats = broker.get(f"/stats?format=json&topic={topic}").json()
    found = [t for t in stats["topics"] or [] if t["topic_name"] == topic]
    return found[0]["depth"] if found else 0


def test_power_loss_through_the_wrapper_keeps_only_what_was_fsynced(tmp_path):
    # synced: every message fsynced by its own round; unsynced: no round for an hour, nothing fsynced
    synced = WrappedBroker(tmp_path / "a", "--power-loss", mem_queue_size=0, sync_every=1)
    unsynced = WrappedBroker(tmp_path / "b", "--power-loss", mem_queue_size=0, sync_every=100000,
                             sync_timeout="1h")
    try:
        for broker in (synced, unsynced):
            broker.start()
            assert broker.http.post("/topic/create?topic=p").status_code == 200
            assert broker.http.post("/channel/create?topic=p&channel=c").status_code == 200
            broker.http.post("/topic/pause?topic=p")  # nothing read: the depth is what the log holds
            with RawNSQ(broker.tcp_address) as conn:
                for n in range(20):
                    conn.pub("p", b"m%d" % n)
            time.sleep(0.5)  # the synced one's rounds ran
            assert broker.proc is not None
            broker.proc.send_signal(signal.SIGUSR1)
            assert broker.proc.wait(10) == 137
            assert "POWER LOSS" in broker.log_text()
            broker.stop()
            broker.start()
        assert _depth(synced, "p") == 20
        assert _depth(unsynced, "p") == 0
    finally:
        synced.kill()
        unsynced.kill()


def test_mutation_flag_is_applied_before_the_broker_starts(tmp_path):
    broker = WrappedBroker(tmp_path, "--mutation=skip-truncation")
    try:
        broker.start()
        assert "MUTATION skip-truncation in force" in broker.log_text()
        assert broker.get("/ping").text == "OK"
    finally:
        broker.kill()
    bad = WrappedBroker(tmp_path, "--mutation=no-such-thing")
    with pytest.raises(AssertionError, match="did not start"):
        bad.start(timeout=5)


def test_nemeses_on_a_cluster_without_replicated_topics(tmp_path):
    """The cluster's nemeses on its processes, before any topic: each does what it says."""
    with Cluster(tmp_path) as cluster:
        victim = cluster.nodes[0]
        assert victim.id in cluster.alive_ids()
        cluster.partition(victim)  # no keepalive reaches etcd: its key lapses with its lease (2 s)
        wait_for(lambda: victim.id not in cluster.alive_ids(), timeout=8, message="the lease to lapse")
        assert victim.is_alive()
        cluster.heal()
        wait_for(lambda: victim.id in cluster.alive_ids(), timeout=10, message="the broker back in etcd")
        cluster.sigstop(victim)
        wait_for(lambda: victim.id not in cluster.alive_ids(), timeout=8, message="the lease to lapse")
        cluster.sigcont(victim)
        wait_for(lambda: victim.id in cluster.alive_ids(), timeout=10, message="the broker back in etcd")
        assert cluster.power_loss_of(victim) == 137
        cluster.restart(victim)
        cluster.kill9(victim)
        assert not victim.is_alive()
        cluster.restart(victim)
        wait_for(lambda: len(cluster.alive_ids()) == 3, timeout=10, message="all three in etcd")


# --- the runs ------------------------------------------------------------------------------------------

def _leader(cluster: Cluster) -> Node:
    return cluster.wait_for_leader(TOPIC, timeout=30)


def leader_kill9(cluster: Cluster, down: float = 3.0) -> None:
    node = _leader(cluster)
    cluster.kill9(node)
    time.sleep(down)  # past the lease (2 s): a follower takes over; shorter: it proposes a new epoch itself
    cluster.restart(node)


def leader_pause(cluster: Cluster, paused: float = 4.0) -> None:
    node = _leader(cluster)
    cluster.sigstop(node)
    time.sleep(paused)  # past its lease: a new leader is elected meanwhile
    cluster.sigcont(node)  # it wakes up believing it leads: its publishes must never be answered OK


def leader_partition(cluster: Cluster, cut: float = 5.0) -> None:
    node = _leader(cluster)
    cluster.partition(node)
    time.sleep(cut)
    cluster.heal()


def leader_power_loss(cluster: Cluster, down: float = 1.0) -> None:
    node = _leader(cluster)
    cluster.power_loss_of(node)
    time.sleep(down)
    cluster.restart(node)


def _follower(cluster: Cluster, pick: float) -> Node:
    """One of the brokers etcd does not name leader, by `pick` in [0, 1) (drawn with the schedule)."""
    leader = cluster.leader_of(TOPIC)
    followers = [node for node in cluster.nodes if node is not leader]
    return followers[min(int(pick * len(followers)), len(followers) - 1)]


def follower_kill9(cluster: Cluster, down: float, pick: float) -> None:
    node = _follower(cluster, pick)
    cluster.kill9(node)
    time.sleep(down)
    cluster.restart(node)  # it truncates to where its leader's epochs say, and catches up


def follower_pause(cluster: Cluster, paused: float, pick: float) -> None:
    node = _follower(cluster, pick)
    cluster.sigstop(node)
    time.sleep(paused)  # shorter than the lease: its key stays, it may drop out of the isr (lag time 2 s)
    cluster.sigcont(node)


def nemesis_schedule(cluster: Cluster) -> list[tuple[str, Callable[[], None]]]:
    """The fixed run's nemeses in turn, each on whoever leads then, each followed by its recovery."""
    return [("kill -9", lambda: leader_kill9(cluster)), ("SIGSTOP", lambda: leader_pause(cluster)),
            ("partition", lambda: leader_partition(cluster)), ("power loss", lambda: leader_power_loss(cluster))]


@attrs.frozen
class Fault:
    """One fault of a random schedule, drawn in full before the run so a seed replays it: what, for how
    long (seconds down, paused or cut), the gap after it (recovery under load, then a snapshot), and for a
    follower's fault which follower (`pick` in [0, 1) over the non-leaders in node order)."""

    kind: str
    duration: float
    gap: float
    pick: float

    def on_leader(self) -> bool:
        return self.kind.endswith("leader")

    def __str__(self) -> str:
        return f"{self.kind} {self.duration:.1f}s +{self.gap:.1f}s"


# the random run's faults: kind -> (how to strike, the range its duration is drawn from)
RANDOM_FAULTS: dict[str, tuple[Callable[[Cluster, Fault], None], tuple[float, float]]] = {
    "kill -9 leader": (lambda c, f: leader_kill9(c, f.duration), (1.0, 3.5)),  # restarted before/after the lease
    "SIGSTOP leader": (lambda c, f: leader_pause(c, f.duration), (3.0, 4.5)),  # past the 2 s lease
    "partition leader": (lambda c, f: leader_partition(c, f.duration), (3.0, 5.0)),  # past the lease
    "power loss leader": (lambda c, f: leader_power_loss(c, f.duration), (0.5, 2.0)),
    "kill -9 follower": (lambda c, f: follower_kill9(c, f.duration, f.pick), (0.5, 3.0)),
    "SIGSTOP follower": (lambda c, f: follower_pause(c, f.duration, f.pick), (0.3, 1.2)),  # within the lease
}
RANDOM_GAP = (0.5, 3.0)
RANDOM_COUNT = (6, 8)
# what the faults may take, estimated (each one's duration and gap, and a second for a restart or a wait
# for the leader): past it a schedule of more than RANDOM_COUNT[0] faults loses its last ones, so the run
# stays under a minute (its cluster, warm-up, heal, drain and check take ~12 s more)
RANDOM_BUDGET = 40.0


def random_schedule(rng: random.Random) -> list[Fault]:
    faults = []
    for _ in range(rng.randint(*RANDOM_COUNT)):
        kind = rng.choice(sorted(RANDOM_FAULTS))
        faults.append(Fault(kind, round(rng.uniform(*RANDOM_FAULTS[kind][1]), 2), round(rng.uniform(*RANDOM_GAP), 2),
                            rng.random()))
    while len(faults) > RANDOM_COUNT[0] and sum(f.duration + f.gap + 1.0 for f in faults) > RANDOM_BUDGET:
        faults.pop()
    return faults


def jepsen_seed() -> int:
    """JEPSEN_SEED from the environment (to replay a schedule), else a fresh one (printed by the run)."""
    given = os.environ.get("JEPSEN_SEED")
    return int(given) if given else random.SystemRandom().randrange(1 << 32)


# the main runs: the first broker's disk is slower (its segment fsyncs wait this long), so when it leads,
# its followers hold records it has not fsynced, and a power loss of it makes them truncate
RUN_FSYNC_DELAY = [0.2, 0.0, 0.0]
# how many times the fixed run goes through its nemeses (JEPSEN_ROUNDS=10 for a longer soak by hand)
ROUNDS = int(os.environ.get("JEPSEN_ROUNDS", "1"))


@attrs.frozen
class RunResult:
    report: Report
    history: History
    epoch: int  # the topic's epoch at the end
    relayed: dict[str, int]  # bytes each broker's HTTP proxy relayed (fetches from it)
    ok_by_producer: dict[str, int]
    seconds: float


def main_run(tmp_path: Path, label: str, nemeses: Callable[[Cluster, History], None],
             warmup: float = 3.0) -> RunResult:
    """What both main runs share: the cluster (RUN_FSYNC_DELAY), the topic, the producers (one through
    nsqlookupd) and the live consumer; `warmup` seconds of load, then `nemeses(cluster, history)` (which
    snapshots as it goes), then the producers stopped, everything healed, drained and judged."""
    began = time.monotonic()
    history = History()
    stop = threading.Event()
    with new_cluster(tmp_path, fsync_delay=RUN_FSYNC_DELAY) as cluster:
        make_topic(cluster)
        producers = start_producers(cluster, history, stop, mpub=20, lookupd=True)
        consumer = LiveConsumer(cluster, stop)
        consumer.start()
        try:
            time.sleep(warmup)
            nemeses(cluster, history)
        finally:
            stop_producers(producers, stop)
            consumer.join(10)
        assert not consumer.is_alive() and consumer.error is None, f"[{label}] {consumer.error!r}"
        print(f"[{label}] the live consumer got {len(consumer.delivered)} messages over {consumer.connections} "
              f"connections")
        ok_ids = history.ok_ids()
        ok_by_producer = {p.prefix: sum(1 for op_id in ok_ids if op_id.startswith(p.prefix + "-")) for p in producers}
        lookups = [p for p in producers if isinstance(p, LookupdProducer)]
        print(f"[{label}] ops answered OK per producer: {ok_by_producer}; through nsqlookupd: "
              + ", ".join(f"{p.prefix} {p.lookups} lookups, {p.listed_several} listing several brokers"
                          for p in lookups))
        report = judge(cluster, history, label, consumed=consumer.delivered)
        epoch = (cluster.state(TOPIC) or {}).get("epoch", 0)
        relayed = {node.name: node.http_proxy.relayed for node in cluster.nodes}
        print(f"[{label}] bytes relayed by each broker's HTTP proxy (fetches from it): {relayed}")
    seconds = time.monotonic() - began
    print(f"[{label}] total {seconds:.1f}s")
    return RunResult(report, history, epoch, relayed, ok_by_producer, seconds)


def test_jepsen_run_loses_nothing_ok(tmp_path):
    done: list[str] = []

    def nemeses(cluster: Cluster, history: History) -> None:
        for name, nemesis in nemesis_schedule(cluster) * ROUNDS:
            at = time.monotonic()
            nemesis()
            done.append(name)
            time.sleep(3)  # recovery under load
            snapshot(cluster, history, f"after {name}")
            print(f"[run] {name}: {time.monotonic() - at:.1f}s; ops so far {len(history.records)}, "
                  f"ok {len(history.ok_ids())}")

    run = main_run(tmp_path, "run", nemeses)
    assert run.report.valid, run.report.summary()
    assert run.report.ok > 100, "the run published too little to mean anything"
    assert run.ok_by_producer["l1"] > 0, f"the producer through nsqlookupd got no OK: {run.ok_by_producer}"
    assert len(run.history.snapshots) == len(done), "a snapshot after each nemesis"
    # every nemesis took the lead from its leader (a restarted leader proposes a new epoch too)
    assert run.epoch >= 1 + len(done), f"only {run.epoch} epochs: a nemesis changed nothing"
    # the topology is what the partition relies on: every broker led at some point and its followers
    # fetched from it through its HTTP proxy (its advertised address), not around it
    assert all(run.relayed.values()), f"a leader's followers fetched around its proxy: {run.relayed}"


def test_jepsen_random_run_loses_nothing_ok(tmp_path):
    """The nemeses as Jepsen draws them: RANDOM_COUNT faults of RANDOM_FAULTS, one at a time, with random
    durations and gaps, from a seeded random.Random: JEPSEN_SEED=<the seed printed> replays a schedule
    (the same faults, durations, gaps and follower picks; which broker leads when is the cluster's)."""
    seed = jepsen_seed()
    faults = random_schedule(random.Random(seed))
    label = f"random seed={seed}"
    print(f"\n[{label}] schedule: {'; '.join(map(str, faults))}")

    def nemeses(cluster: Cluster, history: History) -> None:
        for n, fault in enumerate(faults):
            at = time.monotonic()
            RANDOM_FAULTS[fault.kind][0](cluster, fault)
            time.sleep(fault.gap)  # recovery under load, the next fault after it
            snapshot(cluster, history, f"after {n + 1}: {fault.kind}")
            print(f"[{label}] {n + 1}/{len(faults)} {fault}: {time.monotonic() - at:.1f}s; ops so far "
                  f"{len(history.records)}, ok {len(history.ok_ids())}")

    run = main_run(tmp_path, label, nemeses, warmup=RANDOM_GAP[1])
    replay = f"seed {seed} (JEPSEN_SEED={seed} replays it), schedule {'; '.join(map(str, faults))}"
    assert run.report.valid, f"{replay}: {run.report.summary()}"
    assert run.report.ok > 100, f"{replay}: the run published too little to mean anything"
    assert run.ok_by_producer["l1"] > 0, f"{replay}: the producer through nsqlookupd got no OK: {run.ok_by_producer}"
    assert len(run.history.snapshots) == len(faults), f"{replay}: a snapshot after each fault"
    on_leader = sum(fault.on_leader() for fault in faults)
    assert run.epoch >= 1 + on_leader, f"{replay}: only {run.epoch} epochs after {on_leader} faults of a leader"


# --- the mutations ---------------------------------------------------------------------------------------

def publish_some(cluster: Cluster, history: History, prefix: str, count: int, *, kind: str = "tcp",
                 budget: float | None = None, then: Callable[[], None] | None = None) -> list[str]:
    """`count` ops by one producer (or as many as fit in `budget` seconds); the ids answered OK. `then`:
    done once the ops are over or the budget spent, while an op may still wait for its answer (a nemesis
    that must strike before the isr shrinks, whatever the op in flight)."""
    stop = threading.Event()
    producer = Producer(cluster, history, prefix, kind, stop, pause=0.0, limit=count)
    producer.start()
    producer.join(budget if budget is not None else count * OP_TIMEOUT + 5)
    stop.set()
    if then is not None:
        then()
    producer.join(OP_TIMEOUT + 5)
    assert producer.error is None, repr(producer.error)
    return [op_id for op_id in history.ok_ids() if op_id.startswith(prefix + "-")]


def scenario_unreplicated_ok_then_leader_lost(cluster: Cluster, history: History) -> None:
    """For ack-on-leader-alone: the leader's followers cannot fetch (its HTTP proxy cut), it takes
    publishes for a second (the isr has not shrunk yet: 2 s lag time), then dies; a follower takes over
    without those records. Only a leader answering OK on its own fsync makes them lost."""
    leader = cluster.wait_for_leader(TOPIC, isr=3)
    publish_some(cluster, history, "before", 20)
    cluster.note(f"cut the followers' fetches from {leader.name}")
    leader.http_proxy.cut()
    publish_some(cluster, history, "cut", 1000, budget=1.2, then=lambda: cluster.kill9(leader))
    new = cluster.wait_for_leader(TOPIC, other_than=leader, timeout=20)
    publish_some(cluster, history, "after", 20)
    cluster.note(f"new leader {new.name}")


def scenario_followers_lose_power(cluster: Cluster, history: History) -> None:
    """For skip-follower-fsync: a burst answered OK, then at once both followers lose power (only what
    they fsynced stays) and the leader dies; the followers come back and one leads without the records
    they reported synced but had not fsynced."""
    leader = cluster.wait_for_leader(TOPIC, isr=3)
    followers = [node for node in cluster.nodes if node is not leader]
    publish_some(cluster, history, "burst", 200, budget=3.0)
    for node in followers:
        node.signal(signal.SIGUSR1)
    cluster.kill9(leader)
    for node in followers:
        assert node.proc is not None
        node.proc.wait(10)
        node.stop()
        cluster.note(f"power loss of {node.name}")
    for node in followers:
        cluster.restart(node)
    new = cluster.wait_for_leader(TOPIC, other_than=leader, timeout=30)
    cluster.note(f"new leader {new.name}")
    publish_some(cluster, history, "after", 20)


def scenario_divergent_tail(cluster: Cluster, history: History) -> None:
    """For skip-truncation: the leader appends records nobody fetches (its HTTP proxy cut; the publishes
    time out: info), dies; a follower leads epoch 2 and takes as many records of the same size at the same
    positions; the old leader comes back as a follower. Only without truncation does it keep its own tail."""
    leader = cluster.wait_for_leader(TOPIC, isr=3)
    publish_some(cluster, history, "before", 20)
    cluster.note(f"cut the followers' fetches from {leader.name}")
    leader.http_proxy.cut()
    # "orphans" and "newtail": ids of one length, so records of one size: the old leader's end falls on
    # a record boundary of the new leader's log, and an untruncated follower fetches on from there
    publish_some(cluster, history, "orphans", 1000, budget=1.2, then=lambda: cluster.kill9(leader))
    leader.http_proxy.heal()
    new = cluster.wait_for_leader(TOPIC, other_than=leader, timeout=20)
    cluster.note(f"new leader {new.name}")
    publish_some(cluster, history, "newtail", 60)
    cluster.restart(leader)


def scenario_stale_follower_of_a_reelected_leader(cluster: Cluster, history: History) -> None:
    """For skip-epoch-check: a follower cut from etcd (it keeps the TopicState of epoch 1) and paused,
    while the leader, under load, loses power (its tail not yet fsynced is gone: the paused follower holds
    some of it) and comes back before its lease lapses: it proposes epoch 2 itself, at its shorter end,
    and takes new publishes at the positions of the lost ones, past the follower's end. The follower then
    wakes up and fetches from the same address with epoch 1: the epoch check answers FENCED (it cannot
    read etcd: it waits for the heal, then truncates); without it the follower is served from its own end
    and serves, below the high watermark it is told, the lost records: divergent (a mid-run snapshot;
    after the heal it truncates and the copies agree again)."""
    leader = cluster.wait_for_leader(TOPIC, isr=3)
    assert leader is cluster.nodes[0], "the first broker (the slow disk, FSYNC_DELAY) places and leads"
    stale = next(node for node in cluster.nodes if node is not leader)
    stop = threading.Event()
    producers = start_producers(cluster, history, stop, mpub=50, pause=0.0)
    try:
        time.sleep(1.5)
        cluster.note(f"cut {stale.name} from etcd: it stays at epoch {(cluster.state(TOPIC) or {}).get('epoch')}")
        stale.etcd_proxy.cut()
        cluster.sigstop(stale)
        cluster.power_loss_of(leader)
        cluster.restart(leader)  # within the lease's 2 s: its key never lapses, nobody else is elected
        time.sleep(3)  # it leads epoch 2 with the other follower and its log grows past the paused one's
        cluster.sigcont(stale)
        time.sleep(3)
        snapshot(cluster, history, f"{stale.name} cut from etcd")
    finally:
        stop_producers(producers, stop)
    cluster.note(f"state before the heal: {cluster.state(TOPIC)}")


SCENARIOS: dict[str, Callable[[Cluster, History], None]] = {
    "ack-on-leader-alone": scenario_unreplicated_ok_then_leader_lost,
    "skip-follower-fsync": scenario_followers_lose_power,
    "skip-truncation": scenario_divergent_tail,
    "skip-epoch-check": scenario_stale_follower_of_a_reelected_leader,
}


# scenarios that need a slow disk (seconds each segment fsync waits, per node): the first node places the
# topic and leads it; with its disk slower than its followers', they hold records it has not fsynced yet,
# which its power loss takes (with equal disks the window is a few milliseconds: the followers fsync too
# before they fetch again)
FSYNC_DELAY: dict[str, list[float]] = {"skip-epoch-check": [0.5, 0.0, 0.0]}


def run_scenario(tmp_path: Path, name: str, mutation: str | None) -> Report:
    began = time.monotonic()
    history = History()
    with new_cluster(tmp_path, mutation, FSYNC_DELAY.get(name, 0.0)) as cluster:
        make_topic(cluster)
        SCENARIOS[name](cluster, history)
        label = f"{name} {'MUTATED' if mutation else 'control'}"
        report = judge(cluster, history, label, settle=mutation is None)
    print(f"[{label}] total {time.monotonic() - began:.1f}s")
    return report


@pytest.mark.parametrize("mutation", sorted(SCENARIOS))
def test_mutation_makes_the_checker_fail(tmp_path, mutation):
    report = run_scenario(tmp_path, mutation, mutation)
    assert not report.valid, f"the checker missed mutation {mutation}: {report.summary()}"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_without_mutation_is_valid(tmp_path, scenario):
    report = run_scenario(tmp_path, scenario, None)
    assert report.valid, report.summary()
