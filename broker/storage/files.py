"""File steps the disk queue, the idempotency journal and nsqd.dat share: a file written and fsynced
whole, a directory fsynced so a rename in it is durable, a descriptor closed whatever state it is in."""

from __future__ import annotations

import errno
import os


def write_synced(path: str, data: bytes) -> None:
    """Create or truncate `path`, write `data` and fsync it; a short write (a full disk) is ENOSPC."""
    write_and_close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), path, data)


def write_and_close(fd: int, path: str, data: bytes) -> None:
    """Write `data` to the open `fd` in one call, fsync and close it; a short write (a full disk) is ENOSPC."""
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, f"short write of {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """A file's written bytes durable, through a descriptor of our own (fsync flushes the file, not a
    descriptor); a file gone meanwhile (dropped, its topic deleted, a side file never made) has nothing
    to keep."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """After a rename or a new file in `path`: the directory entry is durable once the directory is."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def close_quietly(fd: int | None) -> None:
    """Close a descriptor we are done with; an error closing it says nothing we could act on (what
    matters was fsynced before, or is reported by the fsync that failed)."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def remove_quietly(path: str) -> OSError | None:
    """Remove a file that may be gone already (not an error); any other failure is returned for the
    caller to log in its own words, since a file left behind costs space, not data."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc
    return None
