"""trio-nsqd in this process, for the Jepsen-style test: with a power loss on a signal, or a mutation.

    python -m tests.cluster_node --data-path D [--power-loss] [--mutation NAME] -- <trio-nsqd args>

`--power-loss`: the broker runs inside `tests.power_loss.PowerLoss(D)`, which follows every write and
fsync it makes in D; SIGUSR1 then rewrites D to what a power loss leaves of it (`crash("strict")`: only
what was fsynced) and exits at once with 137, as kill -9 would, with nothing flushed or closed. (A kill -9
alone keeps the page cache: everything written survives, fsynced or not; this is the other half.)

`--mutation NAME`: patch one rule of `trio_nsq.broker.replication.core` before the broker starts, so the
test can show its checker catches the bug (issue 52, "the checker proven by mutations"):
  ack-on-leader-alone   LeaderProgress.high_watermark is the leader's own synced position
  skip-epoch-check      check_fetch_epoch always serves the fetch
  skip-truncation       truncation_point never cuts (the replica's own end)
  skip-follower-fsync   follower_synced reports what was appended, fsynced or not, and the follower
                        does not wait for its fsync before its next fetch (the broker's follower awaits
                        it, so without this the first half changes nothing: _follower_does_not_wait...)
`--fsync-delay SECONDS` (with --power-loss): every fsync of a log segment waits that long first, as on a
slow disk (the storage fsyncs in worker threads: the event loop goes on, the durable tail lags what was
appended and served). A fault of its own, used with and without a mutation: it widens the window in
which followers hold records their leader has not fsynced, which a power loss of the leader then takes.

The broker calls these through the module (`core.x(...)`), so the patch reaches it; core.py is not among
the modules mypyc compiles (trio_nsq/compiled.py), and the tests run with TRIO_NSQ_COMPILE=0 anyway.

`--data-path D` is passed on to the broker unless its own arguments name one. Who runs it: tests/cluster.py.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

MUTATIONS = ("ack-on-leader-alone", "skip-epoch-check", "skip-truncation", "skip-follower-fsync")
POWER_LOSS_EXIT = 137  # what a shell reports for SIGKILL: the test treats both alike


def mutate(name: str) -> None:
    """Patch the rule `name` names in the replication core (see the module docstring)."""
    from trio_nsq.broker.replication import core

    if name == "ack-on-leader-alone":
        def own_synced(self: Any) -> int:
            return int(self._own_synced)

        core.LeaderProgress.high_watermark = property(own_synced)  # type: ignore[method-assign,assignment]
    elif name == "skip-epoch-check":
        def serve_any(leader_epoch: int, follower_epoch: int) -> str | None:
            return None

        core.check_fetch_epoch = serve_any
    elif name == "skip-truncation":
        def never_cut(local_epochs: Any, state: Any, local_end: int, leader_end: int | None = None) -> int:
            return local_end

        core.truncation_point = never_cut
    elif name == "skip-follower-fsync":
        def appended_is_synced(appended: int, synced: int) -> int:
            return appended

        core.follower_synced = appended_is_synced
        _follower_does_not_wait_for_its_fsync()
    else:
        raise SystemExit(f"unknown mutation {name!r}: one of {', '.join(MUTATIONS)}")
    print(f"cluster_node: MUTATION {name} in force", file=sys.stderr, flush=True)


def _follower_does_not_wait_for_its_fsync() -> None:
    """The rest of skip-follower-fsync in this broker: its follower awaits its sync group's round right
    after append_at, before its next fetch, so `follower_synced(appended, synced)` gets appended ==
    synced and the patch above alone changes nothing. Here SyncGroup.sync returns at once when the
    follower (replication/follower.py) calls it: the records reach the disk at the group's next periodic
    round (--sync-timeout), and the follower reports them synced before that. Every other caller (the
    leader's own fsync before an OK) still waits."""
    from trio_nsq.broker.storage.sync_group import SyncGroup

    waiting = SyncGroup.sync

    async def at_once() -> None:
        return None

    def sync(self: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if caller.endswith(os.path.join("replication", "follower.py")):
            return at_once()
        return waiting(self)

    SyncGroup.sync = sync  # type: ignore[method-assign]


def _on_power_loss(disk: Any) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        # runs in the main thread between two bytecodes of whatever the broker was doing: the model
        # keeps only what was fsynced, so where exactly we interrupt does not matter
        disk.crash("strict")
        os.write(2, b"cluster_node: POWER LOSS (strict): data path cut to what was fsynced\n")
        os._exit(POWER_LOSS_EXIT)

    return handler


_SEGMENT = re.compile(r"\.diskqueue\.\d+\.dat$")


def _slow_fsync(delay: float) -> None:
    """Only a topic log's segments are slow: the metadata, cursors and directories (a broker's start
    fsyncs many) are not, so a restart is as quick as usual."""
    for name in ("fsync", "fdatasync"):
        inner = getattr(os, name)

        def slow(fd: Any, inner: Callable[[Any], None] = inner) -> None:
            try:
                path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
            except OSError:
                path = ""
            if _SEGMENT.search(path):
                time.sleep(delay)  # outside PowerLoss's lock: other threads' writes go on meanwhile
            inner(fd)

        setattr(os, name, slow)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, broker_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m tests.cluster_node")
    parser.add_argument("--data-path", required=True)
    parser.add_argument("--power-loss", action="store_true")
    parser.add_argument("--mutation", choices=MUTATIONS)
    parser.add_argument("--fsync-delay", type=float, default=0.0)
    args = parser.parse_args(ours)
    if not any(a == "--data-path" or a.startswith("--data-path=") for a in broker_args):
        broker_args.append(f"--data-path={args.data_path}")
    if args.mutation:
        mutate(args.mutation)

    from trio_nsq.broker.__main__ import main as broker_main

    with ExitStack() as stack:
        if args.power_loss:
            from tests.power_loss import PowerLoss

            disk = stack.enter_context(PowerLoss(args.data_path))
            signal.signal(signal.SIGUSR1, _on_power_loss(disk))
            if args.fsync_delay > 0:
                _slow_fsync(args.fsync_delay)  # over PowerLoss's wrapper, which restores the real one on exit
        broker_main(broker_args)


if __name__ == "__main__":
    main()
