"""SyncGroup: the fsync rounds of one topic's files (go-diskqueue's sync, shared by everything it writes).

A topic's log, the deadline index of its deferred messages, and each channel's cursor (and own queue)
are members of one group. A round asks every member what it has to persist (`prepare`: files written
since the last round to fsync, bytes to append to a cursor file, whole files to replace), does it all in a
worker thread in that order (data before the metadata that names it), then removes the files members no
longer need, and tells every member how it went (`finished`).

Metadata (go-diskqueue's meta file of each log) is written when a segment rolled or went, at the last
round, and otherwise at most every META_INTERVAL: a round for a run of FINs appends the cursor's few
bytes and fsyncs them, nothing more (a restart finds records past a metadata's write position anyway).

When: after sync_every changes (records written, FINs, requeues: go-diskqueue's count of reads and
writes), at once when a file rolls, and every sync_timeout when anything happened (the io_loop, `run`).
`sync()` is a group commit: every caller waiting at one moment shares one round, which covers every record
written before it was called; `when_durable()` is the same without awaiting: a callback once a round covers
what was written so far (a channel finishes a message it moved to another topic only once that topic's
round has fsynced the copy: two groups, ordered). A record a failed round covered is never reported durable afterwards, even
if a later fsync succeeds (Linux may drop the dirty pages of a failed write-back and mark them clean), and
the group reports its health (nsqd's SetHealth): a failed write or fsync says what failed, the next that
succeeds says healthy again.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import attrs
import outcome
import trio

from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.files import fsync_dir, fsync_file, write_and_close, write_synced
from trio_nsq.broker.storage.segment_log import remove_dropped

log = logging.getLogger("nsqd")

# seconds between metadata writes of a log when nothing forces one (go-diskqueue's sync timeout)
META_INTERVAL = 2.0
# seconds between two rounds the io loop starts (sync() does not wait for it)
MIN_ROUND_INTERVAL = 0.01


class SyncMember(Protocol):
    """A TopicLog or a LogReader: what it owns on disk, persisted by the group's rounds."""

    deleted: bool

    def prepare(self, plan: RoundPlan) -> None:
        """Add what this round must persist."""

    def finished(self, plan: RoundPlan, ok: bool) -> None:
        """The round ended (ok: everything of it is durable; else it is to be done again)."""


@attrs.define
class RoundPlan:
    """What one round persists, in this order: segments fsynced, cursor blocks appended (and fsynced),
    files made (a channel's first cursor file) and, when names were made since the last round, the
    directory fsynced, then files replaced (a temp file fsynced and renamed: a log's metadata), the
    directory fsynced, then files removed."""

    fsync: list[str] = attrs.Factory(list)
    appends: list[tuple[SyncMember, str, bytes]] = attrs.Factory(list)
    # whole files whose names are new (a channel's first cursor file): durable before any replace, so a
    # topic's metadata saying what it handed to its channels never is without the cursors that hold it
    creates: list[tuple[SyncMember, str, bytes]] = attrs.Factory(list)
    replaces: list[tuple[SyncMember, str, bytes]] = attrs.Factory(list)
    removes: list[tuple[str, bool, str]] = attrs.Factory(list)  # (path, keep it as .bad, the log's name)
    writes: int = 0  # records written before the round began: the group commit's target
    new_names: bool = False  # a member created a file: the directory is fsynced (renames do it too)
    final: bool = False  # the closing round: every member writes its metadata
    now: float = 0.0  # monotonic time of the round (members write metadata at most every META_INTERVAL)

    def empty(self) -> bool:
        return not (self.fsync or self.appends or self.creates or self.replaces or self.removes)


class _Round:
    __slots__ = ("plan", "done", "error")

    def __init__(self, plan: RoundPlan) -> None:
        self.plan = plan
        self.done = trio.Event()
        self.error: str | None = None


async def _in_thread(fn: Callable[[RoundPlan], None], plan: RoundPlan) -> None:
    """fn(plan) in a worker thread: trio.to_thread.run_sync without its limiter and cancellation
    bookkeeping (half of its cost to the event loop, measured: a round runs for every 2,500 FINs under
    NSQ's bench_reader). A round is never abandoned, so it cannot be cancelled either."""
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()

    def deliver(result: outcome.Outcome[None]) -> None:
        token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    trio.lowlevel.start_thread_soon(partial(fn, plan), deliver)
    await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)


def _call(callback: Callable[[bool], None], ok: bool) -> None:
    """A when_durable callback: a failure in one is logged and costs no other, nor the round."""
    try:
        callback(ok)
    except Exception:
        log.exception("DISKQUEUE: a callback after a sync round failed")


class SyncGroup:
    """Owned by a Topic: `run` is its io_loop (in the topic's nursery); its logs report writes and rolls
    (`wrote`), its cursors report changes (`changed`); publishers with --sync-every=1 await `sync`."""

    def __init__(self, name: str, data_path: str, *, sync_every: int = 2500, sync_timeout: float = 2.0,
                 on_health: Callable[[str | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock  # a round's `now`: when metadata is due
        self.data_path = data_path
        self.sync_every = max(1, sync_every)
        self.sync_timeout = sync_timeout
        self._on_health = on_health
        self.members: list[SyncMember] = []
        self.failing = False
        self.fsync_count = 0  # rounds started
        self._count = 0  # changes since the last round (go-diskqueue's count)
        self._needs_sync = False
        # a round is due now (sync_every reached or a file changed): state, not just the wake event, so a
        # wake that arrives while run() waits out someone else's round is not lost
        self._sync_due = False
        self._writes = 0  # records written so far
        self._synced_writes = 0  # covered by a successful round
        self._failed_writes = 0  # covered by a failed round: never durable as far as we know
        self._round: _Round | None = None
        # (records written when asked, callback): told once a round covered them, or failed to
        self._waiting: list[tuple[int, Callable[[bool], None]]] = []
        self._wake = trio.Event()
        self._idle = False  # run() waits for a first change, without a timer
        self.closed = False
        self._closing = False
        # a round's file writes (in a thread) and a member's removal (in the loop) exclude each other
        self.files_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SyncGroup({self.name})"

    # --- what members report --------------------------------------------------------------------

    def wrote(self, records: int, error: str | None = None) -> None:
        """A log stored `records` records (0 and no error: a file rolled), or failed with `error`."""
        if error is not None:
            self._health(error)
            return
        if self.failing:
            self._health(None)
        if records:
            self._writes += records
            self.changed(records)
        else:
            self.file_changed()

    def changed(self, n: int = 1) -> None:
        self._needs_sync = True
        self._count += n
        if self._count >= self.sync_every:
            self._sync_due = True
            self._wake.set()
        elif self._idle:
            # run() waits without a timer while nothing is to persist: now its sync_timeout starts
            self._idle = False
            self._wake.set()

    def file_changed(self) -> None:
        """go-diskqueue syncs whenever a file changes."""
        self.request_round()

    def request_round(self) -> None:
        """A round now (the io loop starts it), not after sync_every changes or sync_timeout."""
        self._needs_sync = True
        self._sync_due = True
        self._wake.set()

    def when_durable(self, callback: Callable[[bool], None]) -> None:
        """callback(True) once a round has fsynced every record written so far, or callback(False) once a
        round that was to fsync them failed (they are never reported durable then, as sync() says). At
        once when that is known already; else a round is asked for. Called in the event loop, from the
        round's end."""
        target = self._writes
        if target <= self._synced_writes:
            callback(True)
        elif target <= self._failed_writes:
            callback(False)
        else:
            self._waiting.append((target, callback))
            self.request_round()

    def fail_waiting(self) -> None:
        """No round will come (the topic is deleted): every callback waiting is told so."""
        waiting, self._waiting = self._waiting, []
        for _, callback in waiting:
            _call(callback, False)

    def _tell_waiting(self, covered: int, ok: bool) -> None:
        """A round that covered the first `covered` records ended: callbacks waiting for no more hear it."""
        if not self._waiting:
            return
        due = [callback for target, callback in self._waiting if target <= covered]
        if due:
            self._waiting = [(target, callback) for target, callback in self._waiting if target > covered]
            for callback in due:
                _call(callback, ok)

    def _health(self, error: str | None) -> None:
        self.failing = error is not None
        if self._on_health is not None:
            self._on_health(error)

    # --- rounds ---------------------------------------------------------------------------------

    async def sync(self) -> None:
        """Return once every record written before this call is fsynced (and the metadata with it).
        Group commit: a caller arriving while a round is in flight waits for it, and then the first of
        those still not covered starts the next round for all of them."""
        target = self._writes
        while self._synced_writes < target:
            if target <= self._failed_writes:
                raise BackendError(f"failed to sync disk queue {self.name}")
            current = self._round
            if current is not None:
                await current.done.wait()
                if current.error is not None and current.plan.writes >= target:
                    raise BackendError(current.error)
                continue
            if self.closed:
                raise BackendError("exiting")
            await self.sync_round()

    async def sync_round(self) -> None:
        """One round now (after the one in flight, if any); raises BackendError if it failed."""
        while self._round is not None:
            await self._round.done.wait()
        plan = RoundPlan(writes=self._writes, final=self._closing, now=self.clock())
        for member in list(self.members):
            member.prepare(plan)
        current = self._round = _Round(plan)
        count, needs_sync = self._count, self._needs_sync
        self._count = 0
        self._needs_sync = False
        self._sync_due = False
        self.fsync_count += 1
        ok = False
        try:
            await _in_thread(self._persist, plan)
            ok = True
        except OSError as exc:
            current.error = f"failed to sync disk queue {self.name} - {exc}"
            log.error("DISKQUEUE(%s) failed to sync - %s", self.name, exc)
            self._failed_writes = max(self._failed_writes, plan.writes)
            self._health(current.error)
            raise BackendError(current.error) from None
        finally:
            if not ok:
                # not durable: the next round does it again (a failing disk is retried every
                # sync_timeout, not in a loop)
                self._count += count
                self._needs_sync = True
            else:
                self._synced_writes = max(self._synced_writes, plan.writes)
                if self.failing:
                    self._health(None)
            for member in list(self.members):
                member.finished(plan, ok)
            self._round = None
            current.done.set()
            self._tell_waiting(plan.writes, ok)

    def _persist(self, plan: RoundPlan) -> None:
        """In a worker thread. fsync goes through a descriptor of our own (fsync flushes the file, not the
        descriptor), so the event loop may close or replace its write descriptor meanwhile."""
        # one after the other: side by side on a pool of threads was slower compiled (--sync-every=1 MPUB 200
        # x4 at 0.70 of ba431e2's rate against 0.85: each return from a pool thread waits for the GIL)
        for path in plan.fsync:
            fsync_file(path)
        for member, path, data in plan.appends:
            self._append(member, path, data)
        for member, path, data in plan.creates:
            self._replace(member, path, data)
        if plan.replaces and (plan.new_names or plan.creates):
            # names made since the last round (a segment begun at a roll, a channel's first cursor file)
            # durable before the metadata that counts on them is renamed into place: POSIX orders no two
            # names without a directory fsync (a metadata naming a segment whose name a power loss lost
            # leaves its readers a gap; one saying "dispatched" past a channel's messages, with no cursor
            # file, leaves the channel without them). Once a roll or a new channel.
            fsync_dir(self.data_path)
        for member, path, data in plan.replaces:
            self._replace(member, path, data)
        if plan.replaces or plan.creates or plan.new_names:
            fsync_dir(self.data_path)  # the renames and any new file's name
        for path, bad, name in plan.removes:
            remove_dropped(path, bad, name)
        if plan.removes:
            # the removals too: else a power loss brings the files back (SegmentLog removes them at open,
            # but they would take the disk until then)
            fsync_dir(self.data_path)

    def _append(self, member: SyncMember, path: str, data: bytes) -> None:
        """Append a cursor's block and fsync it (unless its owner was deleted meanwhile)."""
        with self.files_lock:
            if member.deleted:
                return
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        write_and_close(fd, path, data)

    def _replace(self, member: SyncMember, path: str, data: bytes) -> None:
        """A whole file: a temp file fsynced and renamed over it (nothing of a deleted owner comes back)."""
        tmp = f"{path}.{random.getrandbits(63)}.tmp"
        try:
            write_synced(tmp, data)
            with self.files_lock:
                if member.deleted:
                    os.remove(tmp)
                    return
                os.rename(tmp, path)
        except OSError:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The io_loop: a round after sync_every changes, when a file changed, or sync_timeout after the
        first change since the last round; ends when the group is closed."""
        task_status.started()
        while not self.closed:
            if not self._wake.is_set() and not self._sync_due:
                if self._needs_sync:
                    with trio.move_on_after(self.sync_timeout):
                        await self._wake.wait()
                else:
                    # nothing to persist: no timer (5,000 idle topics woke 2,500 times a second)
                    self._idle = True
                    try:
                        await self._wake.wait()
                    finally:
                        self._idle = False
                    if not self._sync_due and not self.closed:
                        self._wake = trio.Event()  # a first change: wait sync_timeout for more
                        continue
            self._wake = trio.Event()
            if self.closed:
                break
            if self._round is not None:
                # a sync() round is under way: it covers what woke us up; anything since wakes us again
                await self._round.done.wait()
                continue
            if self._needs_sync:
                try:
                    await self.sync_round()
                except BackendError:
                    pass  # logged; the next round tries again
                # rounds this loop starts are at least MIN_ROUND_INTERVAL apart: under a stream of FINs a
                # round is due at every sync_every of them, and each costs the event loop ~0.1 ms; a
                # publisher waiting for durability (sync()) starts its own round at once
                await trio.sleep(MIN_ROUND_INTERVAL)

    async def close(self) -> bool:
        """The last round (every member's metadata written); no more after it. Whether it succeeded."""
        self._closing = True
        ok = True
        with trio.CancelScope(shield=True):
            try:
                await self.sync_round()
            except BackendError:
                ok = False  # logged
        self.closed = True
        self._wake.set()
        return ok
