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

Who calls it: NSQD lists it at start and gives each Topic its names (`take`); a topic made later, at run
time, takes what the listing had for it (files a crash or Go nsqd left), and owns its files from then on.
"""

from __future__ import annotations

import os


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

    def topics(self) -> list[str]:
        """The topics with files the listing found and no one took yet."""
        return list(self._by_topic)
