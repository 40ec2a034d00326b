"""Go nsqd 1.3.0 on a directory with our CRC side files, and we on what it appended
(`make bench NSQ_REFERENCE=<dir>`; the suite does not need Go's binaries):

    python -m tests.bench.go_side_files --reference DIR

Ours with small segments (several side files), a clean exit; Go nsqd 1.3.0 starts on the directory,
delivers every message, takes 100 more and exits; ours starts and delivers Go's, none cut (a metadata Go
wrote has no `checksums crc32` line, so nothing past it is checked).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tests.nsq_raw import FrameTimeout, Message, RawNSQ
from tests.processes import BrokerProcess


class GoNsqd(BrokerProcess):
    """Go nsqd 1.3.0 on another broker's data directory."""

    def __init__(self, binary: str, base: Path, data: Path, **flags: object) -> None:
        super().__init__(base, **flags)
        self.binary = binary
        self.data_path = data

    def command(self) -> list[str]:
        return [self.binary]


def consume(address: str, count: int, quiet: float = 3.0) -> list[bytes]:
    """Every message channel `c` of topic `t` delivers (FIN'd), until `count` came and `quiet` seconds
    pass without another."""
    out: list[bytes] = []
    with RawNSQ(address, timeout=10) as conn:
        conn.sub("t", "c")
        conn.rdy(500)
        while True:
            try:
                frame = conn.next_frame(quiet if len(out) >= count else 20)
            except FrameTimeout:
                return out
            if isinstance(frame, Message):
                conn.fin(frame.id)
                out.append(frame.body)


def run(binary: str, base: Path) -> None:
    ours = BrokerProcess(base, mem_queue_size=0, max_bytes_per_file=4096)
    ours.start()
    bodies = [b"ours-%04d" % i for i in range(600)]
    try:
        with RawNSQ(ours.tcp_address, timeout=10) as conn:
            conn.sub("t", "c")  # the channel, before the messages
        with RawNSQ(ours.tcp_address, timeout=10) as conn:
            for at in range(0, len(bodies), 50):
                conn.mpub("t", bodies[at:at + 50])
    finally:
        assert ours.stop() == 0
    data = ours.data_path
    sides = len(list(data.glob("t.diskqueue.*.crc")))
    assert sides > 3, sides
    go = GoNsqd(binary, base, data, mem_queue_size=0, max_bytes_per_file=4096)
    go.start()
    more = [b"go-%04d" % i for i in range(100)]
    try:
        got = sorted(consume(go.tcp_address, len(bodies)))
        assert got == bodies, f"Go nsqd delivered {len(got)} of our {len(bodies)}"
        with RawNSQ(go.tcp_address, timeout=10) as conn:
            conn.mpub("t", more)
    finally:
        assert go.stop() == 0
    ours.start()
    try:
        got = sorted(consume(ours.tcp_address, len(more)))
        assert got == more, f"we delivered {len(got)} of Go's {len(more)}"
        assert "cutting" not in ours.log_text()
    finally:
        assert ours.stop() == 0
    print(f"go side files: Go nsqd 1.3.0 delivered all {len(bodies)} of ours from a directory with {sides} "
          f"side files; we delivered all {len(more)} it appended, nothing cut")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, help="the folder with Go's nsqd 1.3.0")
    args = parser.parse_args()
    binary = os.path.join(args.reference, "nsqd")
    if not os.access(binary, os.X_OK):
        sys.exit(f"no Go nsqd at {binary}")
    with tempfile.TemporaryDirectory() as base:
        run(binary, Path(base))


if __name__ == "__main__":
    main()
