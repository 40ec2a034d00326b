"""A replicated trio-nsq cluster in processes, with the nemeses of the Jepsen-style test (issue 52).

    from cluster import Cluster

    with Cluster(tmp_path) as cluster:           # etcd, nsqlookupd, 3 trio-nsqd in cluster mode, started
        leader = cluster.wait_for_leader("t")    # the Node etcd names leader of topic t (alive, registered)
        cluster.kill9(leader); cluster.restart(leader)
        cluster.sigstop(leader); cluster.sigcont(leader)
        cluster.partition(leader); cluster.heal()
        cluster.power_loss_of(leader)            # files cut to what was fsynced, the process gone (137)
        cluster.state("t")                       # the TopicState etcd holds (a dict), or None

The network. Every broker reaches etcd through a proxy of its own (`node.etcd_proxy`, tests/net_proxy.py),
and advertises `--broadcast-address=127.0.0.1 --broadcast-http-port=<node.http_proxy.port>`: its broker id
(`127.0.0.1:<that port>`) is where followers fetch from, so every fetch from it goes through its HTTP proxy.
A partition of a node is both cut: it hears nothing from etcd (its lease lapses, it must fence itself) and
no follower fetches from it (nothing it appends can be committed). Its own fetches, were it a follower,
go through the other nodes' proxies, which stay up; a partitioned leader learns from nobody that it no
longer leads, so it does not fetch. The test's own clients (producers, the consumer, the checker's reads)
use the brokers' real ports: clients on the leader's side of a partition, as Jepsen keeps them, so the
old leader keeps taking publishes that it must never answer OK.

Each broker runs through `python -m tests.cluster_node` (tests/cluster_node.py), inside a PowerLoss
harness when `power_loss=True` (the default here), with `mutation=` patched in when asked, and with a slow
disk (`fsync_delay=`: seconds each segment fsync waits; one for all or one per node) when asked.

Sync (subprocess, time.sleep), as tests/processes.py: the Jepsen test's producers are threads.
"""

from __future__ import annotations

import base64
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from etcd_server import EtcdServer
from net_proxy import Proxy
from processes import BrokerProcess, LookupdProcess, wait_for

PREFIX = "/trio-nsq"
# the brief's flags: leases and the lag time short so a run's failovers take seconds
CLUSTER_FLAGS = {"etcd_lease_ttl": "2s", "replica_lag_time": "2s", "replicas": 3, "min_isr": 2}


class Node(BrokerProcess):
    """One trio-nsqd of the cluster, run by tests/cluster_node.py, behind its two proxies."""

    def __init__(self, base_dir: Path, etcd_port: int, *args: str, power_loss: bool = True,
                 mutation: str | None = None, fsync_delay: float = 0.0, **flags: object) -> None:
        super().__init__(base_dir, *args, env=None, **flags)
        self.power_loss = power_loss
        self.mutation = mutation
        self.fsync_delay = fsync_delay
        self.etcd_proxy = Proxy(("127.0.0.1", etcd_port), name=f"{self.name}->etcd").start()
        self.http_proxy = Proxy(("127.0.0.1", self.http_port), name=f"->{self.name}.http").start()
        self.flags.update(broadcast_address="127.0.0.1", broadcast_http_port=self.http_proxy.port,
                          etcd_endpoints=f"http://127.0.0.1:{self.etcd_proxy.port}")
        self.stopped = False  # SIGSTOPped now
        self.start_offset = 0  # where its log stood when it was last started

    def start(self, timeout: float = 15.0, ready_url: str | None = None) -> Node:
        self.start_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        super().start(timeout, ready_url)
        return self

    @property
    def id(self) -> str:
        """Its broker id as the cluster knows it: `<broadcast-address>:<advertised http port>`."""
        return f"127.0.0.1:{self.http_proxy.port}"

    def command(self) -> list[str]:
        extra = ["--power-loss"] if self.power_loss else []
        if self.mutation:
            extra.append(f"--mutation={self.mutation}")
        if self.fsync_delay:
            extra.append(f"--fsync-delay={self.fsync_delay}")
        return [sys.executable, "-m", "tests.cluster_node", f"--data-path={self.data_path}", *extra, "--"]

    def signal(self, sig: int) -> None:
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} is not running"
        self.proc.send_signal(sig)

    def close_proxies(self) -> None:
        self.etcd_proxy.close()
        self.http_proxy.close()

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else ("alive" if self.is_alive() else "down")
        return f"<{self.name} id={self.id} tcp={self.tcp_address} http={self.http_address} {state}>"


class Cluster:
    """etcd + nsqlookupd + `size` trio-nsqd in cluster mode, on loopback, in `base_dir` (see the module
    docstring). Extra broker flags by keyword (they override CLUSTER_FLAGS)."""

    def __init__(self, base_dir: Path, size: int = 3, *, power_loss: bool = True, mutation: str | None = None,
                 fsync_delay: float | Sequence[float] = 0.0, **flags: object) -> None:
        self.base_dir = Path(base_dir)
        self.etcd = EtcdServer(self.base_dir)
        self.lookupd = LookupdProcess(self.base_dir)
        self.flags = {**CLUSTER_FLAGS, **flags}
        self.nodes: list[Node] = []
        self.size = size
        self.power_loss = power_loss
        self.mutation = mutation
        # seconds each segment fsync waits first (tests/cluster_node.py --fsync-delay): one for all, or per node
        self.fsync_delays = [float(fsync_delay)] * size if isinstance(fsync_delay, (int, float)) else list(fsync_delay)
        self._etcd_http: httpx.Client | None = None
        self.events: list[tuple[float, str]] = []  # (monotonic time, what a nemesis did): for the report

    # --- life --------------------------------------------------------------------------------------

    def start(self) -> Cluster:
        self.etcd.start()
        self.lookupd.start()
        lookupd = f"--lookupd-tcp-address={self.lookupd.tcp_address}"
        for n in range(self.size):
            node = Node(self.base_dir, self.etcd.client_port, lookupd, power_loss=self.power_loss,
                        mutation=self.mutation, fsync_delay=self.fsync_delays[n], **self.flags)
            self.nodes.append(node)
        for node in self.nodes:
            node.start()
        wait_for(lambda: len(self.alive_ids()) == self.size, timeout=15, message="every broker's key in etcd")
        # and every broker has seen the others' keys (its watch): a topic placed before that would get
        # fewer replicas (placement takes the brokers alive in the placing broker's view)
        ids = {node.id for node in self.nodes}
        for node in self.nodes:
            wait_for(lambda: ids <= self.seen_by(node), timeout=15, message=f"{node.name} to see every broker")
        return self

    def seen_by(self, node: Node) -> set[str]:
        """The broker ids `node` has logged as alive since its last start (`CLUSTER: brokers alive: ...`)."""
        seen: set[str] = set()
        for line in node.log_text(node.start_offset).splitlines():
            _, found, rest = line.partition("CLUSTER: brokers alive: ")
            if found:
                seen.update(part.strip() for part in rest.split(","))
        return seen

    def stop(self) -> None:
        for node in self.nodes:
            if node.stopped and node.is_alive():
                node.signal(signal.SIGCONT)
            node.kill() if node.is_alive() else node.stop()
            node.close_proxies()
        self.lookupd.stop()
        self.etcd.stop()
        if self._etcd_http is not None:
            self._etcd_http.close()

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def note(self, what: str) -> None:
        self.events.append((time.monotonic(), what))
        print(f"[nemesis {time.strftime('%H:%M:%S')}] {what}", flush=True)

    # --- etcd, read directly (not through any proxy) ---------------------------------------------

    @property
    def etcd_http(self) -> httpx.Client:
        if self._etcd_http is None:
            self._etcd_http = httpx.Client(base_url=self.etcd.endpoint, timeout=2.0)
        return self._etcd_http

    def _range(self, key: str, prefix: bool = False, client: httpx.Client | None = None) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"key": base64.b64encode(key.encode()).decode()}
        if prefix:
            end = bytearray(key.encode())
            end[-1] += 1
            body["range_end"] = base64.b64encode(bytes(end)).decode()
        reply = (client or self.etcd_http).post("/v3/kv/range", json=body)
        reply.raise_for_status()
        return list(reply.json().get("kvs", []))

    def state(self, topic: str, client: httpx.Client | None = None) -> dict[str, Any] | None:
        """The TopicState etcd holds for `topic` (its JSON), or None. `client`: an httpx client on etcd's
        endpoint of the caller's own (a producer thread), else the cluster's."""
        kvs = self._range(f"{PREFIX}/topics/{topic}", client=client)
        return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None

    def alive_ids(self) -> set[str]:
        """The broker ids whose lease-bound keys exist in etcd."""
        return {base64.b64decode(kv["key"]).decode().rsplit("/", 1)[-1]
                for kv in self._range(f"{PREFIX}/brokers/", prefix=True)}

    def node(self, broker_id: str | None) -> Node | None:
        return next((node for node in self.nodes if node.id == broker_id), None)

    def leader_of(self, topic: str) -> Node | None:
        """The node etcd names leader of `topic` (alive or not), or None."""
        state = self.state(topic)
        return None if state is None else self.node(state.get("leader"))

    def wait_for_leader(self, topic: str, timeout: float = 20.0, other_than: Node | None = None,
                        isr: int | None = None) -> Node:
        """Wait until etcd names a leader of `topic` whose key is alive and whose process runs (and is
        not `other_than`; and, with `isr`, with at least that many isr members) and return it."""
        def found() -> Node | None:
            state = self.state(topic)
            if state is None or state.get("leader") is None:
                return None
            node = self.node(state["leader"])
            if node is None or node is other_than or not node.is_alive() or node.stopped:
                return None
            if state["leader"] not in self.alive_ids():
                return None
            if isr is not None and len(state.get("isr", ())) < isr:
                return None
            return node
        try:
            return wait_for(found, timeout=timeout, interval=0.1, message=f"a leader of {topic}",
                            ignore=(httpx.HTTPError,))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; etcd holds {self.state(topic)}, alive {sorted(self.alive_ids())}, "
                                 f"nodes {self.nodes}") from None

    # --- nemeses -------------------------------------------------------------------------------

    def kill9(self, node: Node) -> None:
        self.note(f"kill -9 {node.name}")
        if node.stopped:
            node.signal(signal.SIGCONT)
            node.stopped = False
        node.kill()

    def sigstop(self, node: Node) -> None:
        self.note(f"SIGSTOP {node.name}")
        node.signal(signal.SIGSTOP)
        node.stopped = True

    def sigcont(self, node: Node) -> None:
        self.note(f"SIGCONT {node.name}")
        node.signal(signal.SIGCONT)
        node.stopped = False

    def partition(self, node: Node) -> None:
        """Cut `node` off from etcd and from its followers (module docstring)."""
        self.note(f"partition {node.name} from etcd and its followers")
        node.etcd_proxy.cut()
        node.http_proxy.cut()

    def heal(self) -> None:
        self.note("heal every link")
        for node in self.nodes:
            node.etcd_proxy.heal()
            node.http_proxy.heal()

    def power_loss_of(self, node: Node) -> int | None:
        """SIGUSR1 through cluster_node: the data path cut to what was fsynced, the process gone."""
        assert node.power_loss, f"{node.name} does not run under the power-loss harness"
        self.note(f"power loss of {node.name}")
        if node.stopped:
            node.signal(signal.SIGCONT)
            node.stopped = False
        node.signal(signal.SIGUSR1)
        assert node.proc is not None
        try:
            code = node.proc.wait(10)
        except Exception:
            node.kill()
            raise
        node.stop()  # reaps, closes its log
        return code

    def restart(self, node: Node) -> None:
        self.note(f"restart {node.name}")
        if node.is_alive():
            node.stop()
        node.start()

    def heal_all(self) -> None:
        """Every link healed, every stopped process continued, every dead one restarted."""
        self.heal()
        for node in self.nodes:
            if node.stopped:
                self.sigcont(node)
            if not node.is_alive():
                self.restart(node)
