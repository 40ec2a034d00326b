"""shared/etcd.py, the etcd v3 client of cluster mode, against a real single-node etcd (tests/etcd_server.py)."""

from __future__ import annotations

import contextlib
import socket
import time
from functools import partial

import httpx
import pytest
import trio
from etcd_server import EtcdServer, etcd  # noqa: F401  (etcd: the fixture)
from processes import free_port

from trio_nsq.shared.etcd import Deleted, Etcd, EtcdError, KeyValue, prefix_end


@contextlib.asynccontextmanager
async def client(*endpoints: str, timeout: float = 2.0):
    e = Etcd(list(endpoints), timeout=timeout)
    try:
        yield e
    finally:
        await e.aclose()


def dead_endpoint() -> str:
    """A loopback port nothing listens on: connections are refused at once."""
    return f"http://127.0.0.1:{free_port()}"


async def test_put_get_prefix(etcd: EtcdServer) -> None:
    async with client(etcd.endpoint) as e:
        assert await e.get("/p/a") is None
        rev = await e.put("/p/a", b"1")
        await e.put("/p/b", b"\x00\xff binary")
        await e.put("/p/", b"")  # an empty value, which etcd's JSON leaves out
        await e.put("/q", b"outside")
        kv = await e.get("/p/a")
        assert kv == KeyValue("/p/a", b"1", rev, rev, 0)
        kvs, revision = await e.get_prefix("/p/")
        assert [(k.key, k.value) for k in kvs] == [("/p/", b""), ("/p/a", b"1"), ("/p/b", b"\x00\xff binary")]
        assert revision == rev + 3
        rev2 = await e.put("/p/a", b"2")
        kv2 = await e.get("/p/a")
        assert kv2 is not None and (kv2.value, kv2.mod_revision, kv2.create_revision) == (b"2", rev2, rev)
        await e.delete("/p/a")
        assert await e.get("/p/a") is None
        await e.delete("/p/a")  # absent: no error


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_create_swap_delete_if(etcd: EtcdServer) -> None:
    async with client(etcd.endpoint) as e:
        assert await e.create("/t", b"first") is True
        assert await e.create("/t", b"second") is False
        kv = await e.get("/t")
        assert kv is not None and kv.value == b"first"
        assert await e.swap("/t", b"A", kv.mod_revision) is True
        assert await e.swap("/t", b"B", kv.mod_revision) is False  # stale: A was written since
        now = await e.get("/t")
        assert now is not None and now.value == b"A"
        assert await e.delete_if("/t", kv.mod_revision) is False
        assert await e.delete_if("/t", now.mod_revision) is True
        assert await e.get("/t") is None
        assert await e.swap("/t", b"C", now.mod_revision) is False  # gone: nothing to swap
        assert await e.create("/t", b"again") is True  # absent again: create works


async def test_lease_expiry_removes_key(etcd: EtcdServer) -> None:
    async with client(etcd.endpoint) as e:
        lease = await e.grant(2)
        assert await e.create("/brokers/b1", b"{}", lease=lease) is True
        await e.put("/brokers/b2", b"{}", lease=lease)
        kv = await e.get("/brokers/b1")
        assert kv is not None and kv.lease == lease
        t0 = time.monotonic()
        with trio.fail_after(6):
            while await e.get("/brokers/b1") is not None:
                await trio.sleep(0.1)
        assert time.monotonic() - t0 > 1.0  # not gone before its TTL
        assert await e.get("/brokers/b2") is None
        # a watcher (the registry of alive brokers) sees the expiry as deletions
        expired: list[KeyValue | Deleted] = []
        with trio.fail_after(5):
            async with contextlib.aclosing(e.watch_prefix("/brokers/", kv.mod_revision + 1)) as events:
                async for batch in events:
                    expired.extend(batch)
                    if len(expired) >= 3:
                        break
        assert expired[0].key == "/brokers/b2" and isinstance(expired[0], KeyValue)
        assert {(type(x), x.key) for x in expired[1:]} == {(Deleted, "/brokers/b1"), (Deleted, "/brokers/b2")}
        assert await e.keepalive(lease) <= 0  # expired
        with pytest.raises(EtcdError, match="lease not found"):
            await e.put("/x", b"", lease=lease)


async def test_keepalive_extends_and_revoke(etcd: EtcdServer) -> None:
    async with client(etcd.endpoint) as e:
        lease = await e.grant(2)
        await e.put("/k", b"v", lease=lease)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.5:  # well past the TTL
            assert await e.keepalive(lease) == 2
            await trio.sleep(0.4)
        assert await e.get("/k") is not None
        await e.revoke(lease)
        assert await e.get("/k") is None
        await e.revoke(lease)  # already gone: no error


async def test_watch_sees_put_and_delete(etcd: EtcdServer) -> None:
    async with client(etcd.endpoint) as e:
        await e.put("/w/before", b"0")
        _, revision = await e.get_prefix("/w/")
        seen: list[KeyValue | Deleted] = []

        async def watch(task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with contextlib.aclosing(e.watch_prefix("/w/", revision + 1)) as events:
                task_status.started()
                async for batch in events:
                    seen.extend(batch)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(watch)
                r1 = await e.put("/w/a", b"1")
                await e.put("/other", b"not under the prefix")
                r2 = await e.put("/w/b", b"2")
                await e.delete("/w/a")
                while len(seen) < 3:
                    await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
        assert seen[0] == KeyValue("/w/a", b"1", r1, r1, 0)
        assert seen[1] == KeyValue("/w/b", b"2", r2, r2, 0)
        assert seen[2] == Deleted("/w/a", r2 + 1)
        assert len(seen) == 3

        # from an older revision, the history is replayed (as a restarted watcher resumes)
        replay: list[KeyValue | Deleted] = []
        with trio.move_on_after(5):
            async with contextlib.aclosing(e.watch_prefix("/w/", r1)) as events:
                async for batch in events:
                    replay.extend(batch)
                    if len(replay) >= 3:
                        break
        assert replay == seen


async def test_watch_compacted_revision_raises(etcd: EtcdServer) -> None:
    async with client(etcd.endpoint) as e:
        for i in range(3):
            last = await e.put("/c/k", str(i).encode())
        r = httpx.post(f"{etcd.endpoint}/v3/kv/compaction", json={"revision": str(last)})
        assert r.status_code == 200
        with trio.fail_after(5), pytest.raises(EtcdError, match="compacted"):
            async with contextlib.aclosing(e.watch_prefix("/c/", 1)) as events:
                async for _ in events:
                    pass


async def test_watch_raises_when_etcd_dies(etcd: EtcdServer) -> None:
    async with client(etcd.endpoint) as e:
        _, revision = await e.get_prefix("/d/")

        async def kill_soon() -> None:
            await trio.sleep(0.3)
            await trio.to_thread.run_sync(etcd.kill)

        with trio.fail_after(8):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_soon)
                with pytest.raises(EtcdError, match="every etcd endpoint failed"):
                    async with contextlib.aclosing(e.watch_prefix("/d/", revision + 1)) as events:
                        async for _ in events:
                            pass


async def test_dead_endpoint_first_still_works(etcd: EtcdServer) -> None:
    dead = dead_endpoint()
    async with client(dead, etcd.endpoint) as e:
        await e.put("/a", b"1")
        assert e.endpoints[e._current] == etcd.endpoint  # it stays on the one that answered
        kv = await e.get("/a")
        assert kv is not None and kv.value == b"1"
        assert await e.create("/b", b"") is True  # a txn: not sent to the dead one, so safe to try the next
        lease = await e.grant(5)
        assert await e.keepalive(lease) == 5

        seen: list[KeyValue | Deleted] = []
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    e._current = 0  # the watch, too, passes over the dead one
                    async with contextlib.aclosing(e.watch_prefix("/w", 1)) as events:
                        async for batch in events:
                            seen.extend(batch)
                nursery.start_soon(watch)
                await trio.sleep(0.3)
                await e.put("/w", b"x")
                while not seen:
                    await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
        assert [kv.key for kv in seen] == ["/w"]


async def test_all_endpoints_dead_raises_quickly() -> None:
    a, b = dead_endpoint(), dead_endpoint()
    async with client(a, b) as e:
        t0 = trio.current_time()
        with pytest.raises(EtcdError, match="every etcd endpoint failed") as info:
            await e.get("/x")
        assert a in str(info.value) and b in str(info.value)
        with pytest.raises(EtcdError, match="every etcd endpoint failed"):
            await e.create("/x", b"")
        with pytest.raises(EtcdError, match="every etcd endpoint failed"):
            async with contextlib.aclosing(e.watch_prefix("/x", 1)) as events:
                async for _ in events:
                    pass
        assert trio.current_time() - t0 < 2.0


@pytest.fixture
def silent_endpoint():
    """A listening loopback socket that never accepts: connections open (the kernel's backlog), requests
    go out, no answer ever comes, as from a hung etcd."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_silent_endpoint_times_out(etcd: EtcdServer, silent_endpoint: str) -> None:
    async with client(silent_endpoint, etcd.endpoint, timeout=0.5) as e:
        t0 = trio.current_time()
        await e.put("/a", b"1")  # repeatable: the silent one times out, the next one takes it
        assert 0.4 < trio.current_time() - t0 < 2.0
        e._current = 0
        # a txn that may have reached etcd is not sent again elsewhere: the caller must re-read
        with pytest.raises(EtcdError, match="outcome unknown"):
            await e.swap("/a", b"2", 1)
    async with client(etcd.endpoint) as e:
        kv = await e.get("/a")
        assert kv is not None and kv.value == b"1"


async def test_bad_answers_raise_etcd_error(etcd: EtcdServer) -> None:
    """What etcd answers with an error, and what something that is not etcd answers: EtcdError, no other."""
    async with client(etcd.endpoint) as e:
        with pytest.raises(EtcdError, match="HTTP 404"):
            await e.put("/x", b"", lease=12345)  # no such lease

    async def not_etcd(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        body = b"<html>nope</html>"
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s"
                              % (len(body), body))
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, not_etcd, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        async with client(f"http://127.0.0.1:{port}") as e:
            with pytest.raises(EtcdError, match="not JSON"):
                await e.get("/x")
            with pytest.raises(EtcdError, match="not JSON"):
                async with contextlib.aclosing(e.watch_prefix("/x", 1)) as events:
                    async for _ in events:
                        pass
        nursery.cancel_scope.cancel()


def test_under_trio_run(etcd: EtcdServer) -> None:
    """Outside pytest-trio: a plain trio.run, as the broker runs."""

    async def main() -> bytes | None:
        async with client(etcd.endpoint) as e:
            await e.put("/plain", b"yes")
            kv = await e.get("/plain")
            return kv.value if kv else None

    assert trio.run(main) == b"yes"
