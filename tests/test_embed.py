"""trio_nsq.testing.embed: nsqd/nsqlookupd inside a Trio program and on a thread; the two embedding examples."""

import subprocess
import sys
from pathlib import Path

import httpx
import trio

from trio_nsq import Consumer, Producer, nsqd_in_thread, run_nsqd, run_nsqlookupd

REPO_ROOT = Path(__file__).resolve().parent.parent


def channel_depth(http_address: str, topic: str, channel: str) -> int:
    stats = httpx.get(f"http://{http_address}/stats", params={"format": "json"}).json()
    for t in stats["topics"]:
        if t["topic_name"] == topic:
            for c in t["channels"]:
                if c["channel_name"] == channel:
                    return c["depth"]
    return -1


async def test_run_nsqd_in_nursery_round_trip_and_queued_on_disk(tmp_path):
    """Started with nursery.start on port 0; our client round-trips; cancellation puts what is
    queued in data_path, and a second embedded nsqd on that path finds it."""
    got = []
    async with trio.open_nursery() as nursery:
        nsqd = await nursery.start(lambda task_status: run_nsqd(data_path=str(tmp_path), mem_queue_size=100,
                                                                task_status=task_status))
        assert nsqd.tcp_address.startswith("127.0.0.1:") and not nsqd.tcp_address.endswith(":0")
        done = trio.Event()

        async def handler(message):
            got.append(message.body)
            done.set()

        async with Producer(nsqd.tcp_address) as producer:
            await producer.pub("t", b"a")
            async with Consumer("t", "c", handler, nsqd_tcp_addresses=[nsqd.tcp_address]):
                await done.wait()
            await producer.pub("t", b"b")
        nursery.cancel_scope.cancel()
    assert got == [b"a"]
    assert (tmp_path / "nsqd.dat").exists()
    with nsqd_in_thread(data_path=str(tmp_path)) as again:
        assert channel_depth(again.http_address, "t", "c") == 1


async def test_run_nsqlookupd_and_temporary_data_dir_removed():
    async with trio.open_nursery() as nursery:
        lookupd = await nursery.start(run_nsqlookupd)
        nsqd = await nursery.start(lambda task_status: run_nsqd(
            nsqlookupd_tcp_addresses=[lookupd.tcp_address], task_status=task_status))
        data = Path(nsqd.data_path)
        assert data.is_dir()
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://{lookupd.http_address}/ping")).text == "OK"
        nursery.cancel_scope.cancel()
    assert not data.exists()


def test_unknown_option_raises_type_error():
    try:
        with nsqd_in_thread(no_such_option=1):
            pass
    except TypeError:
        return
    raise AssertionError("no TypeError")


def run_example(name: str, data: Path) -> str:
    done = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / name), str(data)], cwd=REPO_ROOT,
                          env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_examples_exit_cleanly_with_queued_message_on_disk(tmp_path):
    for name in ("embed_trio.py", "embed_asyncio.py"):
        data = tmp_path / name
        data.mkdir()
        assert "consumed one" in run_example(name, data)
        with nsqd_in_thread(data_path=str(data)) as again:
            assert channel_depth(again.http_address, "events", "worker") == 1, name
