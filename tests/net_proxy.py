"""A TCP relay the test controls: one network link it can cut (a partition) and heal.

    from net_proxy import Proxy

    proxy = Proxy(("127.0.0.1", etcd_port)).start()     # listens on a free loopback port: proxy.port
    proxy.cut()             # a partition: every byte either way is dropped, new connections hang
    proxy.cut(reset=True)   # a crash of the link: every connection reset, new ones reset at once
    proxy.heal()            # connections made from now on relay again (the ones silenced are reset)
    proxy.close()

Who uses it: tests/cluster.py puts one in front of each broker's etcd endpoint and one in front of each
broker's advertised HTTP port (where followers fetch from), so "the leader partitioned from etcd and from
its followers" is two cuts.

Why dropped and not refused by default: a real partition loses packets, it does not answer RST. A
broker whose etcd keepalive or fetch just hangs must fence itself by its own clock (the lease deadline),
which a refused connection, failing at once, would not test. A connection silenced by a cut is reset at
heal() (TCP would have timed it out or resumed it; reset is the simpler of the two and clients must
reconnect anyway); the bytes dropped meanwhile are gone, so it could not resume meaningfully.

Threads, not Trio: the test's own code blocks (subprocess waits, time.sleep in wait_for), and the relay
must go on meanwhile. Two threads per connection (one per direction) plus one accepting; a handful of
connections per link in these tests.
"""

from __future__ import annotations

import socket
import struct
import threading

BUFFER = 65536
CONNECT_TIMEOUT = 2.0


def _reset(sock: socket.socket) -> None:
    """Abort a connection with RST (SO_LINGER 0), waking a thread blocked on it (shutdown)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Link:
    """One relayed connection: the client's socket and, unless it was accepted during a cut, the
    target's. `silent`: bytes read either way are dropped (a cut happened while it was open)."""

    def __init__(self, proxy: Proxy, client: socket.socket, upstream: socket.socket | None) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.silent = upstream is None
        self.lock = threading.Lock()
        self.open_pumps = 0
        self.closed = False

    def start(self) -> None:
        if self.upstream is None:
            self.open_pumps = 1
            threading.Thread(target=self._pump, args=(self.client, None), daemon=True).start()
            return
        self.open_pumps = 2
        threading.Thread(target=self._pump, args=(self.client, self.upstream), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.upstream, self.client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket | None) -> None:
        try:
            while True:
                data = src.recv(BUFFER)
                if not data:
                    break
                if self.silent or dst is None:
                    continue  # dropped, as a partition drops packets
                dst.sendall(data)
                self.proxy.relayed += len(data)
            if dst is not None and not self.silent:
                try:
                    dst.shutdown(socket.SHUT_WR)  # half close: pass the EOF on
                except OSError:
                    pass
        except OSError:
            self.abort()  # one side reset or the proxy aborted: the other side is reset too
        finally:
            with self.lock:
                self.open_pumps -= 1
                last = self.open_pumps == 0
            if last:
                self._close()

    def abort(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is not None:
                _reset(sock)

    def _close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            if sock is not None:
                sock.close()
        self.proxy._forget(self)


class Proxy:
    """A relay from 127.0.0.1:`port` (a free port when None) to `target`, per link (module docstring)."""

    def __init__(self, target: tuple[str, int], port: int | None = None, name: str = "") -> None:
        self.target = target
        self.name = name or f"proxy->{target[0]}:{target[1]}"
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port or 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)  # the accept loop looks at `closed` this often
        self.port: int = self._listener.getsockname()[1]
        self.cut_mode: str | None = None  # None (relaying), "drop" or "reset"
        self.closed = False
        self.relayed = 0  # bytes relayed, both ways (a test checks traffic went through)
        self.accepted = 0
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=self.name, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def is_cut(self) -> bool:
        return self.cut_mode is not None

    def start(self) -> Proxy:
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.closed:
                    return
                continue
            client.settimeout(None)
            self.accepted += 1
            mode = self.cut_mode
            if mode == "reset":
                _reset(client)
                client.close()
                continue
            upstream = None
            if mode is None:
                try:
                    upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT)
                    upstream.settimeout(None)
                except OSError:
                    _reset(client)  # the target is down: the client sees its connection refused (reset)
                    client.close()
                    continue
            link = _Link(self, client, upstream)
            with self._lock:
                if self.closed:
                    link.abort()
                self._links.add(link)
            link.start()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def connections(self) -> int:
        with self._lock:
            return len(self._links)

    def cut(self, *, reset: bool = False) -> None:
        """Partition this link: every open connection goes silent (or is reset, with `reset`), and so does
        every new one until heal()."""
        with self._lock:
            self.cut_mode = "reset" if reset else "drop"
            links = list(self._links)
        for link in links:
            if reset:
                link.abort()
            else:
                link.silent = True

    def heal(self) -> None:
        """Relay again from now on; connections silenced by the cut are reset (their bytes are lost)."""
        with self._lock:
            self.cut_mode = None
            silenced = [link for link in self._links if link.silent]
        for link in silenced:
            link.abort()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            links = list(self._links)
        for link in links:
            link.abort()
        self._listener.close()
        if self._thread.is_alive():
            self._thread.join(1.0)

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Proxy {self.address} -> {self.target[0]}:{self.target[1]} {self.cut_mode or 'relaying'}>"
