"""DataDir: the data directory listed once at start, its names grouped by the topic they belong to.

Opening a topic, a channel, a segment log or a cursor looks at its own files only: the ones whose names
it knows (go-diskqueue's meta, segments from the meta's numbers on) are opened by name, and what must be
found by listing (temp files a crash left, segments below the first kept, files past a missing one, a
channel's own queue) is looked for among the names the start-up listing gave its topic. So opening one
costs what it has on disk, not what the directory holds, and a broker holding ten thousand topics starts
in time linear in them (the listing was once per object opened: quadratic).

A file belongs to a topic by its name: `<topic>:<channel>...` (a channel's cursor, its own queue),
`<topic>.diskqueue...` (the topic's log and its deadlines), `<topic>.idempotency...`. Topic names may hold
dots (and even "diskqueue"), so the topic is what comes before the *last* `.diskqueue.` or
`.idempotency`; a name that is none of these belongs to no topic.

Who calls it: NSQD lists it at start, takes away (and removes) the names of topics and channels a loaded
nsqd.dat does not name (`take`, `take_channels`: what a deletion left behind), and gives each Topic its
names (`take`); a topic made later, at run time, takes what the listing had for it (files a crash or Go
nsqd left when there was no nsqd.dat to say whose they are), and owns its files from then on.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def topic_of(name: str) -> str | None:
    """The topic a file of the data directory belongs to (None: it belongs to none)."""
    colon = name.find(":")
    if colon > 0:
        return name[:colon]
    for marker in (".diskqueue.", ".idempotency."):
        at = name.rfind(marker)
        if at > 0:
            return name[:at]
    return None


def channel_of(name: str) -> str | None:
    """The channel a file of the data directory belongs to (`<topic>:<channel>.cursor...` or
    `<topic>:<channel>.diskqueue...`; None: a topic's own file, or a name none of these). Channel
    names may hold dots: the channel is what comes before the last marker."""
    colon = name.find(":")
    if colon <= 0:
        return None
    rest = name[colon + 1:]
    at = max(rest.rfind(".cursor."), rest.rfind(".diskqueue."))
    return rest[:at] if at > 0 else None


class DataDir:
    """Made by NSQD at start (`read`); each Topic takes its names once."""

    def __init__(self, names: list[str]) -> None:
        self._by_topic: dict[str, list[str]] = {}
        for name in names:
            topic = topic_of(name)
            if topic is not None:
                self._by_topic.setdefault(topic, []).append(name)

    @classmethod
    def read(cls, path: str) -> DataDir:
        try:
            names = os.listdir(path)
        except OSError:
            names = []
        return cls(names)

    def take(self, topic: str) -> list[str]:
        """The names the listing had for `topic` (none the second time: the topic owns its files now)."""
        return self._by_topic.pop(topic, [])

    def take_channels(self, topic: str, gone: Callable[[str], bool]) -> list[str]:
        """The names the listing had for the channels of `topic` that `gone` selects (taken: the topic
        does not get them); a name whose channel cannot be told stays the topic's."""
        names = self._by_topic.get(topic, [])
        taken = [name for name in names if (channel := channel_of(name)) is not None and gone(channel)]
        if taken:
            gone_names = set(taken)
            self._by_topic[topic] = [name for name in names if name not in gone_names]
        return taken

    def topics(self) -> list[str]:
        """The topics with files the listing found and no one took yet."""
        return list(self._by_topic)


class ChannelNames:
    """A topic's names of its channels' files (`<topic>:<channel>.*`: cursors, own queues), by channel:
    opening or creating one of a thousand channels looks at its own files, not at every channel's.
    Channel names may hold dots, so names are kept in buckets by what precedes the first dot after the
    colon, and a channel's are the names of its bucket that start with `<topic>:<channel>.`.

    Who calls it: Topic, when it opens a channel's reader or own queue and when it deletes a channel."""

    def __init__(self, names: list[str]) -> None:
        self._buckets: dict[str, list[str]] = {}
        for name in names:
            if ":" in name:
                self._buckets.setdefault(_bucket(name), []).append(name)

    def of(self, path_name: str) -> list[str]:
        """The names that start with `<path_name>.` (`<topic>:<channel>`): its files, and those of a
        channel whose name continues its own with a dot (each reader and queue tests its exact names)."""
        prefix = path_name + "."
        return [name for name in self._buckets.get(_bucket(prefix), ()) if name.startswith(prefix)]

    def forget(self, path_name: str) -> None:
        """The channel's files are gone (and so the names of it a start-up listing had)."""
        prefix = path_name + "."
        bucket = _bucket(prefix)
        kept = [name for name in self._buckets.get(bucket, ()) if not name.startswith(prefix)]
        if kept:
            self._buckets[bucket] = kept
        else:
            self._buckets.pop(bucket, None)


def _bucket(name: str) -> str:
    dot = name.find(".", name.find(":") + 1)
    return name[:dot] if dot >= 0 else name
