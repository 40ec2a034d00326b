"""The README's consume command: python -m shared.tail prints what was published."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO_ROOT
from nsq_raw import RawNSQ


def test_tail_prints_published_bodies(broker):
    # published first: a topic keeps its messages until a channel exists, then the tail's channel gets them
    with RawNSQ(broker.tcp_address) as pub:
        for body in (b"hello", b"new\nline", b"world"):
            pub.command("PUB", "tour", body=body)
            pub.expect_response(b"OK")
    tail = subprocess.run(
        [sys.executable, "-m", "shared.tail", "--nsqd-tcp-address", broker.tcp_address, "--topic", "tour", "-n", "3"],
        cwd=str(REPO_ROOT), capture_output=True, timeout=20, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout == b"hello\nnew\nline\nworld\n"
