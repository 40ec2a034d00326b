"""nsqd.dat and its journal: the topics and channels the broker has, on disk before a creation is answered.

Go nsqd writes the whole of nsqd.dat again after every change (PersistMetadata): with ten thousand topics
that is a megabyte written and fsynced per creation, and making them is quadratic. Here a change is a line
appended to `nsqd.dat.journal` and fsynced (one append covers every change made before it began, as the
sync group's round covers publishes), and nsqd.dat itself is written again (compacted) only once the
journal is as large as it, a second after the last change, and at a clean exit: linear in what changes.
After a compaction or a clean exit there is no journal, so the data directory is Go's again; a crash
leaves at most a second's changes (or a journal's worth, while changes keep coming) in the journal, which
trio-nsqd replays at start. Go nsqd, which knows no journal, sees nsqd.dat as compacted last.

A journal line is a JSON array:
    ["T", topic, entry]           the topic's whole nsqd.dat entry (its channels too), or null: deleted
    ["C", topic, channel, entry]  one channel's entry in its topic's, or null: deleted
Replaying sets each to what it says: a line replayed twice, or over an nsqd.dat that holds it already,
changes nothing. A line that does not parse (a crash tore the last append) ends the journal; it is cut
there at start, and every append writes at the end of what was last fsynced.

A compaction, in this order: the changes not in the journal yet are appended to it when there is one (so
the latest line of each topic and channel it holds is what they are now), nsqd.dat is written to a
temporary file, fsynced and renamed over nsqd.dat, the directory fsynced, then the journal unlinked and the
directory fsynced again. A crash anywhere in between leaves nsqd.dat old or new, with or without the
journal, and each of those replays to the state written.

What is deleted stays deleted: a deletion removes the files first (NSQD, Topic), then the line that says so
is written, and the data directory is fsynced before that line (`_append`, and a compaction's rename is
followed by a directory fsync), so a line saying "deleted" is never durable while the files' removal is
not. A journal line counts only once the journal's own name is durable in the directory: a flag only a
successful directory fsync sets (a journal created by a write that failed, or left empty by a kill, gets
its directory fsynced by the next append). At start, lines a kill -9 left in the page cache only are
fsynced (with the journal's name) before anything acts on them.

Who calls it: NSQD loads it at start, tells it of every change (`changed`) and creation (`created`), runs
`run` in its nursery and calls `write_now` at a clean exit; the HTTP API awaits `persisted` (creations,
pauses, deletions) and `persist_now` (settings); a publish or a SUB that made a topic or a channel awaits
`persisted` once `unnamed` holds it (its name is not on disk yet), over HTTP and TCP (`names.sync`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import trio

from trio_nsq.broker.queue_settings import QueueSettings
from trio_nsq.broker.storage.backend import BackendError
from trio_nsq.broker.storage.files import fsync_dir, write_synced
from trio_nsq.shared.version import VERSION

if TYPE_CHECKING:
    from trio_nsq.broker.nsqd import NSQD
    from trio_nsq.broker.topic import Topic

log = logging.getLogger("nsqd")

METADATA_FILE = "nsqd.dat"
JOURNAL_FILE = "nsqd.dat.journal"
# nsqd.dat is written again once the journal holds this much, or as much as nsqd.dat if that is more
JOURNAL_MIN = 64 * 1024
# ... or this long after the last change (seconds): what Go nsqd would miss of a crashed broker's topics
COMPACT_AFTER = 1.0
# seconds before a failed write is tried again
RETRY_AFTER = 1.0
# how a journal line saying "deleted" ends (an entry's line ends with "}]")
DELETION = b"null]\n"


def topic_entry(topic: Topic) -> dict[str, Any]:
    """A topic's nsqd.dat entry as Go writes it (null for no channels: a Go nil slice)."""
    channels = [channel_entry(ch) for ch in topic.channels.values() if not ch.ephemeral]
    return with_settings({"name": topic.name, "paused": topic.paused, "channels": channels or None}, topic.settings)


def channel_entry(channel: Any) -> dict[str, Any]:
    """A channel's entry; a positional reader's cursor (/log/commit) says so: "cursor", and "cursor_idle"
    once it no longer keeps the log (keys Go's json.Unmarshal ignores; none on a consumer's channel)."""
    entry: dict[str, Any] = {"name": channel.name, "paused": channel.paused}
    if channel.cursor:
        entry["cursor"] = True
        if not channel.pins:
            entry["cursor_idle"] = True
    return with_settings(entry, channel.settings)


def with_settings(entry: dict[str, Any], settings: QueueSettings) -> dict[str, Any]:
    """A topic's or channel's nsqd.dat entry, with what was set on it under "config" (not in nsqd, which
    ignores the key; nothing is added where nothing is set, so the file stays Go's byte for byte)."""
    if not settings.is_empty():
        entry["config"] = settings.to_json()
    return entry


def dumps(value: Any) -> bytes:
    """JSON as Go's encoding/json writes it here (compact; the keys in the order given)."""
    return json.dumps(value, separators=(",", ":")).encode()


def parse_metadata(raw: bytes) -> list[dict[str, Any]]:
    """The topics of an nsqd.dat; Go writes null for an empty list. Raises ValueError for a file Go's
    json.Unmarshal into nsqd's struct would refuse (not JSON, or a field of the wrong type)."""
    meta = json.loads(raw)
    if not isinstance(meta, dict):
        raise ValueError("not a JSON object")
    topics = meta.get("topics") or []
    if not isinstance(topics, list) or not all(isinstance(t, dict) for t in topics):
        raise ValueError("'topics' is not a list of objects")
    for t in topics:
        _check_topic(t)
    return topics


def _check_topic(t: dict[str, Any]) -> None:
    channels = t.get("channels") or []
    if not isinstance(channels, list) or not all(isinstance(c, dict) for c in channels):
        raise ValueError("'channels' is not a list of objects")
    for item in [t, *channels]:
        _check_item(item)


def _check_item(item: dict[str, Any]) -> None:
    if not isinstance(item.get("name", ""), str) or not isinstance(item.get("paused", False), bool):
        raise ValueError("a name that is not a string or a paused that is not a bool")


def replay(topics: dict[str, dict[str, Any]], journal: bytes) -> int:
    """Apply the journal's lines to `topics` (nsqd.dat's entries by name, in order); the length of the
    journal's good part (a line that does not parse ends it)."""
    # the channels of each topic a "C" line touched, by name while replaying (a line is O(1), not O(channels))
    channels: dict[str, dict[str, dict[str, Any]]] = {}
    good = 0
    while (end := journal.find(b"\n", good)) >= 0:
        try:
            _apply(topics, channels, json.loads(journal[good:end]))
        except (ValueError, TypeError, IndexError, KeyError):
            break
        good = end + 1
    for name, by_name in channels.items():
        topics[name]["channels"] = list(by_name.values()) or None
    return good


def _apply(topics: dict[str, dict[str, Any]], channels: dict[str, dict[str, dict[str, Any]]],
           record: list[Any]) -> None:
    kind, name = record[0], record[1]
    if not isinstance(name, str):
        raise ValueError("a name that is not a string")
    if kind == "T":
        entry = record[2]
        channels.pop(name, None)
        if entry is None:
            topics.pop(name, None)
        else:
            _check_topic(entry)
            topics[name] = entry
    elif kind == "C":
        channel, entry = record[2], record[3]
        if not isinstance(channel, str):
            raise ValueError("a name that is not a string")
        topic = topics.get(name)
        if topic is None:
            return  # its topic is gone since (a later "T" line said so)
        by_name = channels.get(name)
        if by_name is None:
            by_name = channels[name] = {c.get("name", ""): c for c in topic.get("channels") or ()}
        if entry is None:
            by_name.pop(channel, None)
        else:
            _check_item(entry)
            by_name[channel] = entry
    else:
        raise ValueError(f"unknown record {kind!r}")


def read_metadata(data_path: str) -> tuple[list[dict[str, Any]], int, int]:
    """nsqd.dat's topics with the journal replayed over them; the journal's good length and its size.
    Raises ValueError for an nsqd.dat Go would refuse."""
    try:
        with open(os.path.join(data_path, METADATA_FILE), "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raw = b""
    topics: dict[str, dict[str, Any]] = {}
    if raw:
        for t in parse_metadata(raw):
            topics.setdefault(t.get("name", ""), t)
    try:
        with open(os.path.join(data_path, JOURNAL_FILE), "rb") as fh:
            journal = fh.read()
    except FileNotFoundError:
        journal = b""
    good = replay(topics, journal) if journal else 0
    return list(topics.values()), good, len(journal)


def unnamed_key(topic: str, channel: str = "") -> str:
    """A topic's or a channel's key in `Metadata.unnamed` (no valid name holds a colon)."""
    return f"{topic}:{channel}" if channel else topic


class Names:
    """What a TCP answer awaits (in a client's pending_sync, as a sync group is) when its command made a
    topic or a channel: the metadata write naming it."""

    def __init__(self, meta: Metadata) -> None:
        self.meta = meta

    async def sync(self) -> None:
        try:
            await self.meta.persisted()
        except OSError as exc:
            raise BackendError(f"failed to persist metadata - {exc}") from None


class Metadata:
    """nsqd.dat and its journal for one NSQD: what changed since the last write, the writes, and who
    waits for them."""

    def __init__(self, nsqd: NSQD) -> None:
        self.nsqd = nsqd
        self.path = os.path.join(nsqd.data_path, METADATA_FILE)
        self.journal_path = os.path.join(nsqd.data_path, JOURNAL_FILE)
        # changes counted, what the last write covered, what a failed write covered (retried by the next)
        self.changes = 0
        self.covered = 0
        self.failed = 0
        # each topic's nsqd.dat entry kept as JSON: a compaction makes again only those that changed
        self._entries: dict[str, bytes] = {}
        self._stale: set[str] = set()
        # what the next journal append writes: (topic, channel) changed, "" for the topic's whole entry
        self._unjournaled: dict[tuple[str, str], None] = {}
        self._compact = False  # the next write is a compaction, whatever the journal's size
        self._journal_size = 0  # what the journal holds, fsynced
        # the journal's name is durable in the data directory: set only by a successful directory fsync
        # after it was made (or found at start), cleared when it is unlinked
        self._journal_named = False
        # nsqd.dat (or a journal naming topics) was there at start and loaded: what it does not name was
        # deleted (NSQD removes such files at start; not when nsqd.dat is missing)
        self.found = False
        # topics and channels made at run time whose line is not written yet (unnamed_key -> the change
        # that made them): what published to them or subscribed is answered once they are named
        self.unnamed: dict[str, int] = {}
        self.names = Names(self)
        self._dat_size = 0
        self._wake = trio.Event()
        self._written = trio.Event()
        self._lock = trio.Lock()  # one write at a time: they share the files
        # where the file work runs (tests under trio's MockClock run it inline: a worker thread's real
        # time would let the mock clock jump, a heartbeat before the OK of a PUB that made its topic)
        self.run_sync: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync

    # --- loading ------------------------------------------------------------------------------

    def load(self) -> list[dict[str, Any]]:
        """The topics nsqd.dat and its journal name. A journal's torn end is cut off now (so an append
        never follows it), and a journal is compacted by the first write."""
        try:
            self._dat_size = os.stat(self.path).st_size
        except FileNotFoundError:
            self._dat_size = 0
        topics, good, size = read_metadata(self.nsqd.data_path)
        if good < size:
            log.warning("%s: %d bytes past its last whole line dropped", self.journal_path, size - good)
            os.truncate(self.journal_path, good)
        if good:
            # a kill -9 may have left these lines in the page cache only: on disk, and the journal's
            # name with them, before the broker acts on them (a power loss next must not undo them)
            with open(self.journal_path, "rb+") as fh:
                os.fsync(fh.fileno())
            fsync_dir(self.nsqd.data_path)
            self._journal_named = True
        elif size:
            with open(self.journal_path, "rb+") as fh:
                os.fsync(fh.fileno())  # (cut to nothing: the next append fsyncs its directory)
        self._journal_size = good
        self.found = self._dat_size > 0
        if size:
            self._compact = True
            self.changes += 1
        return topics

    # --- changes ------------------------------------------------------------------------------

    def changed(self, topic: str, channel: str = "") -> None:
        """`topic`'s entry changed (`channel`: only that channel's): the writer puts it on disk, one write
        covering every change made before it began."""
        self._stale.add(topic)
        self._unjournaled[(topic, channel)] = None
        self.changes += 1
        self._wake.set()

    def created(self, topic: str, channel: str = "") -> None:
        """`topic` (or its `channel`) was made at run time: changed, and unnamed until that is on disk."""
        self.changed(topic, channel)
        self.unnamed[unnamed_key(topic, channel)] = self.changes

    def is_named(self, topic: str, channel: str = "") -> bool:
        """Whether nothing waits for the topic's (or channel's) line: made before, or written since."""
        unnamed = self.unnamed
        return not unnamed or (topic not in unnamed and (not channel or unnamed_key(topic, channel) not in unnamed))

    async def persisted(self) -> None:
        """Return once a write begun after this call's changes is on disk. Raises OSError if the write
        covering them failed."""
        target = self.changes
        while self.covered < target:
            if self.failed >= target:
                raise OSError("failed to persist metadata")
            await self._written.wait()

    # --- writing ------------------------------------------------------------------------------

    async def run(self) -> None:
        """The writer: a journal append for what changed, a compaction when one is due (the journal as
        large as nsqd.dat, or a second without a change)."""
        while True:
            if self.covered >= self.changes and not self._compact:
                if self._journal_size:
                    with trio.move_on_after(COMPACT_AFTER):
                        await self._wake.wait()
                    self._compact = not self._wake.is_set()
                else:
                    await self._wake.wait()
                self._wake = trio.Event()
                continue
            try:
                await self.persist_now()
            except OSError as exc:
                log.error("failed to persist metadata - %s", exc)
                await trio.sleep(RETRY_AFTER)  # the disk is failing: again in a moment, not in a loop

    async def persist_now(self) -> None:
        """Write now what changed and return once it is on disk. Raises OSError."""
        async with self._lock:
            covers = self.changes
            keys, self._unjournaled = self._unjournaled, {}
            lines = self._journal_lines(keys)
            compact = self._compact or self._journal_size + len(lines) > max(JOURNAL_MIN, self._dat_size)
            self._compact = False
            try:
                if compact:
                    await self.run_sync(self._compact_files, lines, self.metadata_bytes())
                else:
                    await self.run_sync(self._append, lines)
            except OSError:
                self.failed = max(self.failed, covers)
                # the changes it held are written by the next write (as they are then)
                self._unjournaled = {**keys, **self._unjournaled}
                self._compact = self._compact or compact
                raise
            finally:
                written, self._written = self._written, trio.Event()
                written.set()
            self.covered = max(self.covered, covers)
            self._named(covers)

    def _named(self, covers: int) -> None:
        """The creations up to change `covers` are on disk."""
        if self.unnamed:
            self.unnamed = {key: change for key, change in self.unnamed.items() if change > covers}

    def write_now(self) -> None:
        """A compaction in the caller's thread (a clean exit): nsqd.dat as Go's, no journal left."""
        keys, self._unjournaled = self._unjournaled, {}
        self._compact_files(self._journal_lines(keys), self.metadata_bytes())
        self.covered = self.changes
        self._named(self.covered)

    def _journal_lines(self, keys: dict[tuple[str, str], None]) -> bytes:
        """The journal lines of the topics and channels in `keys`, as they are now."""
        whole = {topic for topic, channel in keys if not channel}
        topics = self.nsqd.topics
        lines = []
        for topic_name, channel_name in keys:
            topic = topics.get(topic_name)
            if not channel_name:
                entry = None if topic is None or topic.ephemeral else topic_entry(topic)
                lines.append(dumps(["T", topic_name, entry]))
            elif topic_name not in whole and topic is not None and not topic.ephemeral:
                channel = topic.channels.get(channel_name)
                entry = None if channel is None or channel.ephemeral else channel_entry(channel)
                lines.append(dumps(["C", topic_name, channel_name, entry]))
        return b"".join(line + b"\n" for line in lines)

    def metadata_bytes(self) -> bytes:
        """nsqd.dat's bytes: each topic's entry made again only if it changed since the last call."""
        entries = self._entries
        for name in self._stale:
            entries.pop(name, None)
        self._stale.clear()
        parts: list[bytes] = []
        for topic in self.nsqd.topics.values():
            if topic.ephemeral:
                continue
            entry = entries.get(topic.name)
            if entry is None:
                entry = entries[topic.name] = dumps(topic_entry(topic))
            parts.append(entry)
        parts.extend(map(dumps, self.nsqd.pending_topics()))  # as nsqd.dat had them: not open yet
        topics = b"[" + b",".join(parts) + b"]" if parts else b"null"
        return b'{"topics":' + topics + b',"version":' + dumps(VERSION) + b"}"

    # --- files (in a worker thread, or at exit) -----------------------------------------------

    def _append(self, lines: bytes) -> None:
        """The lines written where the journal's fsynced part ends (over what a failed append left), and
        fsynced; the journal's name is fsynced into its directory too until once done. Lines that say
        "deleted" (`null`) follow a directory fsync: the files the deletion removed are gone for good
        before the line is (else a power loss could bring them back under a name made again)."""
        if not lines:
            return
        if DELETION in lines:
            fsync_dir(self.nsqd.data_path)
        fd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size > self._journal_size:
                os.ftruncate(fd, self._journal_size)
            if os.pwrite(fd, lines, self._journal_size) != len(lines):
                raise OSError(errno.ENOSPC, f"short write of {self.journal_path}")
            os.fsync(fd)
        finally:
            os.close(fd)
        if not self._journal_named:
            fsync_dir(self.nsqd.data_path)
            self._journal_named = True
        self._journal_size += len(lines)

    def _compact_files(self, lines: bytes, data: bytes) -> None:
        if self._journal_size:
            self._append(lines)  # the journal's last word on everything is what nsqd.dat will say
        tmp = f"{self.path}.{os.getpid()}.tmp"
        write_synced(tmp, data)  # 0600, as Go nsqd's writeSyncFile
        os.replace(tmp, self.path)
        fsync_dir(self.nsqd.data_path)
        self._dat_size = len(data)
        try:
            os.unlink(self.journal_path)
        except FileNotFoundError:
            pass
        else:
            self._journal_named = False
            fsync_dir(self.nsqd.data_path)
        self._journal_size = 0


def valid(entries: Any, is_valid: Callable[[str], bool], kind: str) -> Iterator[dict[str, Any]]:
    """The nsqd.dat entries with a valid name; nsqd skips the others with a warning."""
    for entry in entries:
        name = entry.setdefault("name", "")
        if is_valid(name):
            yield entry
        else:
            log.warning("skipping creation of invalid %s %s", kind, name)
