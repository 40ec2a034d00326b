"""IdempotencyKeys: the `Idempotency-Key`s a topic accepted on /pub and /mpub, for a window.

A request whose key the topic accepted before publishes nothing and is answered as the first was
(200 OK); one whose key is still being stored waits for the first one's outcome. Only a publish that
succeeded is remembered, so a failed first attempt leaves the key free for its retry.

Durability: a key is exactly as durable as the messages it covers.
- When the answer waited for the messages' fsync (--sync-every=1 and every message of the request went
  to the disk queue), the key is appended to `<topic>.idempotency.dat` and fsynced after the messages'
  fsync and before the answer. Crash window: messages fsynced but key not yet -> a retry publishes them
  again (a duplicate); never the reverse (a key remembered for messages that were not stored, a loss).
- When every message of the request went to the topic's log without an fsync before the answer (a
  topic read by position, --mem-queue-size=0, a full memory queue), the key is appended to the journal
  without an fsync, with the log position its messages end at: a kill -9 keeps both (the page cache), and
  at the next start a key whose position the log does not hold (past its end, or in the gap a torn
  segment left: a power loss cut the log, whatever the journal kept) is dropped, so a retry publishes
  again; never a key kept for messages lost. (A segment rolled to since the log's last metadata write is
  given a start past such a gap at open, so after a kill -9 too the keys of its messages are dropped: a
  retry duplicates them.)
- Otherwise (messages in memory) the key is held in memory and journalled at a clean exit with the
  messages themselves, only if every message was flushed and the last round succeeded; a kill -9 loses
  both, so a retry publishes again.
- A key counts as durable only once the journal's name is too (its directory fsynced once per process).

The journal is not a go-diskqueue file (Go nsqd ignores it in the data dir): a header line, then one
line per key, `<expiry unix seconds>[@<log position>] <key>`; a torn last line (kill -9 mid-append) is
ignored. It is
loaded when the topic is created (expired keys dropped), rewritten when it holds more than twice the
table bound, and removed with the topic.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import trio

from trio_nsq.broker.storage.files import close_quietly, fsync_dir, remove_quietly, write_synced

log = logging.getLogger("nsqd")

MAX_KEY_LENGTH = 256
JOURNAL_HEADER = b"# trio-nsqd idempotency keys v1\n"


def valid_key(key: str) -> bool:
    """1..256 printable ASCII characters (space to tilde)."""
    return 0 < len(key) <= MAX_KEY_LENGTH and all(" " <= ch <= "~" for ch in key)


def journal_name(topic_name: str) -> str:
    return f"{topic_name}.idempotency.dat"


class IdempotencyKeys:
    def __init__(self, topic_name: str, data_path: str | None, *, window: float, max_keys: int,
                 log_holds: Callable[[int], bool] | None = None) -> None:
        """`log_holds(position)`: whether the topic's log at this start holds the records that end at a
        position (keys of messages past its end, or in a gap lost records left, are dropped)."""
        self.topic_name = topic_name
        self.log_holds = log_holds
        self.window = window
        self.max_keys = max(1, max_keys)
        self.path = os.path.join(data_path, journal_name(topic_name)) if data_path else None
        self.keys: OrderedDict[str, float] = OrderedDict()  # key -> expiry (wall clock), oldest first
        self._durable: set[str] = set()  # keys already fsynced in the journal
        self._at: dict[str, int] = {}  # keys journalled without an fsync -> where their messages end in the log
        self._pending: dict[str, trio.Event] = {}  # keys whose first request is still publishing
        self._journal_lines = 0
        self._fd: int | None = None
        # the journal's name is in a directory a successful fsync made durable (only that sets it): a
        # key is not durable before
        self._name_durable = False
        self._warned_full = False
        self._closed = False
        # group commit of journal appends: every waiter of one moment shares one fsync
        self._appended = 0
        self._synced = 0
        self._round: trio.Event | None = None
        self._load()

    def held(self) -> int:
        """How many keys the topic holds now (for /stats)."""
        self._expire(time.time())
        return len(self.keys)

    # --- the check -----------------------------------------------------------------------------

    async def publish_once(self, key: str, publish: Callable[[], Awaitable[tuple[bool, int | None]]]) -> None:
        """Run `publish` unless the key was accepted already (or is, by a request in flight that
        succeeds). `publish` raises on failure and returns whether its messages are durable now, and,
        when they all went to the log, the log position they end at."""
        while True:
            self._expire(time.time())
            if key in self.keys:
                return
            pending = self._pending.get(key)
            if pending is None:
                break
            await pending.wait()
        done = self._pending[key] = trio.Event()
        try:
            durable, log_end = await publish()
            self._remember(key)
            if durable and self.path is not None:
                await self._journal([key])
            elif log_end is not None and self.path is not None:
                self._journal_written(key, log_end)
        finally:
            del self._pending[key]
            done.set()

    def _remember(self, key: str) -> None:
        self.keys[key] = time.time() + self.window
        self.keys.move_to_end(key)
        while len(self.keys) > self.max_keys:
            old, _ = self.keys.popitem(last=False)
            self._durable.discard(old)
            self._at.pop(old, None)
            if not self._warned_full:
                self._warned_full = True
                log.warning("TOPIC(%s): idempotency key table full (%d, --max-idempotency-keys): "
                            "forgetting the oldest keys", self.topic_name, self.max_keys)

    def _expire(self, now: float) -> None:
        keys = self.keys
        while keys:
            key, expiry = next(iter(keys.items()))
            if expiry > now:
                break
            keys.popitem(last=False)
            self._durable.discard(key)
            self._at.pop(key, None)

    # --- the journal ---------------------------------------------------------------------------

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error("TOPIC(%s): failed to read %s - %s", self.topic_name, self.path, exc)
            return
        now = time.time()
        lines = raw.split(b"\n")
        lines.pop()  # after the last newline: empty, or a line torn by a crash
        loaded: OrderedDict[str, float] = OrderedDict()
        at: dict[str, int] = {}
        entries = 0
        lost = 0
        for line in lines:
            if line.startswith(b"#"):
                continue
            entries += 1
            try:
                expiry_text, key = line.decode("ascii").split(" ", 1)
                expiry_text, _, position_text = expiry_text.partition("@")
                expiry = float(expiry_text)
                position = int(position_text) if position_text else None
            except ValueError:
                log.warning("TOPIC(%s): skipping a bad line in %s", self.topic_name, self.path)
                continue
            if position is not None and (self.log_holds is None or not self.log_holds(position)):
                lost += 1  # its messages are not all in the log (a power loss cut it): a retry publishes
                continue
            if expiry > now and valid_key(key):
                loaded.pop(key, None)
                loaded[key] = min(expiry, now + self.window)
                at.pop(key, None)
                if position is not None:
                    at[key] = position
        if lost:
            log.warning("TOPIC(%s): %d idempotency keys dropped: their messages are past the end of the log",
                        self.topic_name, lost)
        # oldest first, the newest max_keys of them
        ordered = sorted(loaded.items(), key=lambda item: item[1])[-self.max_keys:]
        self.keys = OrderedDict(ordered)
        self._at = {key: at[key] for key in self.keys if key in at}
        self._durable = {key for key in self.keys if key not in self._at}
        self._journal_lines = entries
        if entries > len(self.keys):  # expired, forgotten or bad lines: compact
            self._rewrite()
        log.info("TOPIC(%s): loaded %d idempotency keys", self.topic_name, len(self.keys))

    def _line(self, key: str) -> bytes:
        position = self._at.get(key)
        if position is None:
            return f"{self.keys[key]:.3f} {key}\n".encode("ascii")
        return f"{self.keys[key]:.3f}@{position} {key}\n".encode("ascii")

    def _rewrite(self, keys: list[str] | None = None) -> None:
        """Write the journal anew (only `keys`, default the durable ones): a temp file, fsynced,
        renamed over the old one."""
        assert self.path is not None
        self._close_fd()
        keep = [k for k in self.keys if k in self._durable or k in self._at] if keys is None else keys
        tmp = f"{self.path}.tmp"
        data = JOURNAL_HEADER + b"".join(self._line(k) for k in keep)
        self._name_durable = False
        try:
            write_synced(tmp, data)
            os.rename(tmp, self.path)
            fsync_dir(os.path.dirname(self.path))
        except OSError as exc:
            log.error("TOPIC(%s): failed to write %s - %s", self.topic_name, self.path, exc)
            return
        self._name_durable = True
        self._durable = {k for k in keep if k not in self._at}
        self._journal_lines = len(keep)

    def _open_journal(self) -> int:
        assert self.path is not None
        if self._fd is None:
            new = not os.path.exists(self.path)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            if new:
                os.write(self._fd, JOURNAL_HEADER)
        return self._fd

    def _journal_written(self, key: str, log_end: int) -> None:
        """A key whose messages are in the log, not fsynced: appended without an fsync, with where they
        end (a kill -9 keeps both; a start after a power loss drops it if the log is shorter)."""
        if self._closed or self.path is None:
            return
        if self._journal_lines >= 2 * self.max_keys and self._round is None:
            self._rewrite()
        self._at[key] = log_end
        try:
            data = self._line(key)
            if os.write(self._open_journal(), data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as exc:
            log.error("TOPIC(%s): failed to journal an idempotency key - %s", self.topic_name, exc)
            self._close_fd()
            return
        self._journal_lines += 1

    async def _journal(self, keys: list[str]) -> None:
        """Append keys and return once they are fsynced (group commit). A failure is logged and the
        keys stay in memory only: a retry after a crash then duplicates, never loses."""
        if self._closed or self.path is None:
            return
        if self._journal_lines >= 2 * self.max_keys and self._round is None:
            # bounded: drop the forgotten and expired keys from the file (once per max_keys appends)
            self._rewrite()
        for k in keys:
            self._at.pop(k, None)  # fsynced after its messages were: no position needed
        try:
            data = b"".join(self._line(k) for k in keys if k in self.keys)
            if os.write(self._open_journal(), data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as exc:
            log.error("TOPIC(%s): failed to journal idempotency keys - %s", self.topic_name, exc)
            self._close_fd()
            return
        self._journal_lines += len(keys)
        self._appended += 1
        target = self._appended
        while self._synced < target:
            if self._round is not None:
                await self._round.wait()
                continue
            self._round = done = trio.Event()
            upto = self._appended
            fd = self._fd
            try:
                if fd is not None:
                    await trio.to_thread.run_sync(os.fsync, fd)
                if not self._name_durable:
                    # made (or found, maybe left by a kill -9 before its directory's fsync) since
                    await trio.to_thread.run_sync(fsync_dir, os.path.dirname(self.path))
                    self._name_durable = True
                self._synced = max(self._synced, upto)
            except OSError as exc:
                log.error("TOPIC(%s): failed to fsync %s - %s", self.topic_name, self.path, exc)
                return
            finally:
                self._round = None
                done.set()
        self._durable.update(keys)

    def _close_fd(self) -> None:
        close_quietly(self._fd)
        self._fd = None

    # --- lifetime ------------------------------------------------------------------------------

    def close(self, flushed: bool = True) -> None:
        """At a clean exit: every key held goes to the journal when the messages were flushed to disk
        and persisted (`flushed`); otherwise only those journalled already (durable, or with the log
        position their messages end at): the keys of messages held in memory covered messages that may
        be lost, and a retry must publish them again."""
        if self._closed:
            return
        self._closed = True
        if self.path is not None and (self.keys or self._journal_lines):
            self._expire(time.time())
            if flushed:
                self._rewrite(list(self.keys))
            else:
                dropped = [k for k in self.keys if k not in self._durable and k not in self._at]
                if dropped:
                    log.warning("TOPIC(%s): %d idempotency keys not kept: their messages were not flushed",
                                self.topic_name, len(dropped))
                self._rewrite()
        self._close_fd()

    def delete(self) -> None:
        """The topic is deleted: forget every key and remove the journal."""
        self._closed = True
        self._close_fd()
        self.keys.clear()
        self._durable.clear()
        if self.path is not None:
            for path in (self.path, f"{self.path}.tmp"):
                failed = remove_quietly(path)
                if failed is not None:
                    log.error("TOPIC(%s): failed to remove %s - %s", self.topic_name, path, failed)
