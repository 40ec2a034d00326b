"""nsqd's health and group commit when the disk fails, on the real broker process.

- A backend write that fails (a full disk) makes the broker unhealthy: `/ping` answers 500
  `NOK - <error>` and `/stats` says the same, until a write succeeds again (nsqd's SetHealth).
- With `--sync-every=1` a publish is answered OK only once it is fsynced; when the fsync fails, no
  publish of that batch is answered OK. The fsync failure is real to the process: a small LD_PRELOAD
  library, built here with the system's C compiler, makes fsync() fail with EIO while a flag file exists.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from processes import BrokerProcess
from trio_nsq.shared.protocol import FrameParser, encode_mpub, encode_pub
from test_durability import _connect, _create_channel, _read_frame, consume

FAIL_FSYNC_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

static int failing(void) {
    const char *flag = getenv("FAIL_FSYNC_FLAG");
    return flag != NULL && access(flag, F_OK) == 0;
}

int fsync(int fd) {
    static int (*real)(int);
    if (failing()) { errno = EIO; return -1; }
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (failing()) { errno = EIO; return -1; }
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    return real(fd);
}
"""


def http_get(broker: BrokerProcess, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{broker.http_address}{path}", timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def health(broker: BrokerProcess) -> str:
    return json.loads(http_get(broker, "/stats?format=json")[1])["health"]


def read_all_frames(sock, timeout: float = 10) -> list[tuple[int, bytes]]:
    """Every frame until the broker closes the connection."""
    parser, frames = FrameParser(), []
    while True:
        frame = _read_frame(sock, parser, timeout)
        if frame is None:
            return frames
        frames.append(frame)


def test_a_failed_write_makes_the_broker_unhealthy_until_a_write_succeeds(small_disk_broker):
    broker = small_disk_broker("4m", mem_queue_size=0)
    mnt = broker.base_dir
    _create_channel(broker, "h", "ch")
    assert http_get(broker, "/ping") == (200, b"OK")
    filler = mnt / "filler"
    # unbuffered: a buffered file would raise ENOSPC again when it closes
    with open(filler, "wb", buffering=0) as fh:  # leave the broker a few KB
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass
    with _connect(broker) as pub:
        parser, answer = FrameParser(), (0, b"OK")
        for i in range(1000):
            pub.sendall(encode_pub("h", b"m%04d" % i + b"x" * 500))
            answer = _read_frame(pub, parser)
            if answer != (0, b"OK"):
                break
    assert answer[0] == 1 and answer[1].startswith(b"E_PUB_FAILED"), answer
    status, body = http_get(broker, "/ping")
    assert status == 500 and body.startswith(b"NOK - ") and b"No space left on device" in body, body
    assert health(broker) == body.decode()

    filler.unlink()
    with _connect(broker) as pub:
        pub.sendall(encode_pub("h", b"after"))
        assert _read_frame(pub, FrameParser()) == (0, b"OK")
    assert http_get(broker, "/ping") == (200, b"OK")
    assert health(broker) == "OK"
    assert broker.is_alive()


@pytest.fixture
def fail_fsync_library(tmp_path) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is needed to build the fsync fault library"
    source = tmp_path / "fail_fsync.c"
    source.write_text(FAIL_FSYNC_C)
    library = tmp_path / "fail_fsync.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"], check=True)
    return library


def test_no_publish_is_answered_ok_when_its_fsync_fails(tmp_path, fail_fsync_library):
    flag = tmp_path / "fsync-fails"
    broker = BrokerProcess(tmp_path, mem_queue_size=0, sync_every=1)
    broker.env = {"LD_PRELOAD": str(fail_fsync_library), "FAIL_FSYNC_FLAG": str(flag)}
    try:
        broker.start()
        _create_channel(broker, "g", "ch")
        with _connect(broker) as pub:
            pub.sendall(encode_pub("g", b"durable"))
            assert _read_frame(pub, FrameParser()) == (0, b"OK")

        flag.touch()
        # one batch of pipelined publishes: the broker reads them together and owes one fsync for all
        with _connect(broker) as pub:
            pub.sendall(b"".join(encode_pub("g", b"batch-%d" % i) for i in range(20)))
            frames = read_all_frames(pub)
        assert (0, b"OK") not in frames, frames
        assert frames and frames[-1][0] == 1 and frames[-1][1].startswith(b"E_PUB_FAILED"), frames
        with _connect(broker) as pub:
            pub.sendall(encode_mpub("g", [b"m1", b"m2"]))
            frames = read_all_frames(pub)
        assert len(frames) == 1 and frames[0][0] == 1 and frames[0][1].startswith(b"E_MPUB_FAILED"), frames
        status, body = http_get(broker, "/ping")
        assert status == 500 and b"Input/output error" in body, body

        flag.unlink()
        with _connect(broker) as pub:
            pub.sendall(encode_pub("g", b"after"))
            assert _read_frame(pub, FrameParser()) == (0, b"OK")
        assert http_get(broker, "/ping") == (200, b"OK")
        seen = consume(broker, "g", "ch", {b"durable", b"after"}, timeout=20)
        assert {b"durable", b"after"} <= seen.keys()
        assert broker.is_alive()
    finally:
        broker.kill()
