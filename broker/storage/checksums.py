"""Checksums: a CRC32 of every append to a segment, in a side file go-diskqueue never opens.

go-diskqueue's records carry no checksum: a record whose length and message id were written back before
a power loss and whose body was not (zeros, or another torn piece) looks whole. Kafka checks a CRC per
batch; so does this, per append batch (one writev run of up to 512 records: one CRC computed over bytes
the write joins anyway, and one 16-byte entry, instead of one per record).

File: `<name>.diskqueue.%06d.crc` beside segment `<name>.diskqueue.%06d.dat` (Go nsqd opens only `.dat`
names it makes itself, and `.bad`): a header of 48 bytes, then entries `[offset uint64 BE][length uint32
BE][crc32 uint32 BE]`, the batch of `length` bytes at `offset` of the segment and zlib's CRC32 of them.
The header `[magic "\xffNSQSEG1"][epoch uint64][segment number uint64][start position uint64][first index
uint64][version uint32][crc32 of the 44 bytes before it uint32]` is written when the segment is begun,
before its first record: at open, a segment the metadata does not name yet (a roll since its last write)
starts where its header says, if whole and of the log's epoch (SegmentLog._recorded_start), so a kill -9
keeps every position and a power loss that cut the segment before it leaves a gap, never a shift. Its
first 8 bytes read as an entry's offset are past 2**63: never a batch's. (A side file without a header, as
the first version of this file wrote, is read as entries from its start.) An entry is written before
its batch (a kill -9 between the two leaves an entry past the file's end, which covers nothing); the side
file is fsynced in the same round as its segment, and its creation made durable by the round's directory
fsync, as the segment's is.

At open, SegmentLog asks `verified_end` for the records past the metadata's write position (what a round
fsynced, the last verified point): batch by batch from there, each must have an entry and match its CRC;
the log is cut at the first that does not. Only where the metadata says `checksums crc32` (every metadata
this version writes): a metadata Go nsqd or an older trio-nsq wrote last means bytes past it may be theirs,
which no entry covers, and nothing is checked at that open. A log with no metadata yet (a power loss before
its first round) is checked where a segment has a side file (only this version makes them). Entries are
found by offset, the last one written for an offset winning (a batch written again where a torn one was
cut, or where a failed write left an entry); an entry of zeros (a torn side file) covers nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import zlib
from collections.abc import Iterable

from trio_nsq.broker.storage.files import close_quietly, remove_quietly

log = logging.getLogger("nsqd")

ENTRY = struct.Struct(">QII")
# the header, three entries long (what the side file holds before its segment's first record): magic, the
# log's epoch, the segment's number, start position and first record's index, a version, and a CRC32 of
# the 44 bytes before it. Its first 8 bytes read as an entry's offset are past 2**63: never a batch's.
HEADER = struct.Struct(">8sQQQQII")
MAGIC = b"\xffNSQSEG1"
_HEADER_VERSION = 1
_ENTRY_SIZE = ENTRY.size
# the hot path's calls, looked up once (an append of one record pays for every lookup); not os.write,
# which is looked up when it runs (tests/power_loss.py replaces it)
_pack = ENTRY.pack
_crc32 = zlib.crc32
# the metadata line saying the side files cover everything appended past its write position
META_KEY = "checksums"
META_VALUE = "crc32"
# the block a verification reads a batch in (a batch may be as long as a segment)
_READ_BLOCK = 1024 * 1024


def side_numbers(names: Iterable[str], stem: str) -> list[int]:
    """The numbers N of side files `<stem>.N.crc` among `names`, in order."""
    prefix = stem + "."
    found = []
    for entry in names:
        if entry.startswith(prefix) and entry.endswith(".crc"):
            number = entry[len(prefix):-4]
            if len(number) >= 6 and number.isdigit() and number.isascii():
                found.append(int(number))
    return sorted(found)


class Checksums:
    """The side files of one SegmentLog, owned by it: the write file's is kept open for appends."""

    __slots__ = ("name", "data_path", "_fd", "_num", "_size")

    def __init__(self, name: str, data_path: str) -> None:
        self.name = name
        self.data_path = data_path
        self._fd: int | None = None
        self._num = -1  # the segment whose side file _fd is
        self._size = 0  # that side file's length

    def file_name(self, num: int) -> str:
        return os.path.join(self.data_path, f"{self.name}.diskqueue.{num:06d}.crc")

    # --- writing ------------------------------------------------------------------------------

    def append(self, num: int, offset: int, data: bytes) -> bool:
        """The entry of `data`, about to be written at `offset` of segment num. Whether the side file was
        created (a new name: the round fsyncs the directory). Raises OSError (the batch is not written)."""
        fd = self._fd
        created = False
        if fd is None or num != self._num:
            created = self._open(num)
            fd = self._fd
            assert fd is not None
        try:
            written = os.write(fd, _pack(offset, len(data), _crc32(data)))
            if written != _ENTRY_SIZE:
                raise OSError(errno.ENOSPC, f"short write of {self.file_name(num)} ({written} of {ENTRY.size})")
        except OSError:
            # a piece of an entry would shift every later one: cut it off, or start afresh at the next open
            try:
                os.ftruncate(fd, self._size)
            except OSError:
                self.close()
            raise
        self._size += _ENTRY_SIZE
        return created

    def begin(self, num: int, epoch: int, start: int, index: int) -> None:
        """Segment num is about to get its first record: its side file starts afresh with the header that
        says where the segment starts in the log (at open, a segment the metadata does not name yet takes
        its start from there). Raises OSError (the record is not written)."""
        self.close()
        path = self.file_name(num)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            body = HEADER.pack(MAGIC, epoch, num, start, index, _HEADER_VERSION, 0)[:-4]
            header = body + _crc32(body).to_bytes(4, "big")
            if os.write(fd, header) != len(header):
                raise OSError(errno.ENOSPC, f"short write of {path}'s header")
        except OSError:
            close_quietly(fd)
            raise
        self._fd, self._num, self._size = fd, num, len(header)

    def header(self, num: int) -> tuple[int, int, int] | None:
        """(epoch, start, index) in segment num's side file's header; None when there is no side file, or
        its header is torn, damaged or another segment's."""
        try:
            with open(self.file_name(num), "rb") as fh:
                data = fh.read(HEADER.size)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("DISKQUEUE(%s) cannot read %s - %s", self.name, self.file_name(num), exc)
            return None
        if len(data) < HEADER.size or not data.startswith(MAGIC):
            return None
        _, epoch, found, start, index, version, crc = HEADER.unpack(data)
        if crc != _crc32(data[:-4]) or version != _HEADER_VERSION or found != num:
            return None
        return epoch, start, index

    def _open(self, num: int) -> bool:
        self.close()
        path = self.file_name(num)
        created = not os.path.exists(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size % ENTRY.size:
                # a torn last entry (a power loss): entries after it must start on an entry boundary
                size -= size % ENTRY.size
                os.ftruncate(fd, size)
        except OSError:
            close_quietly(fd)
            raise
        self._fd, self._num, self._size = fd, num, size
        return created

    def close(self) -> None:
        close_quietly(self._fd)
        self._fd = None
        self._num = -1

    # --- checking at open ---------------------------------------------------------------------

    def _entries(self, num: int) -> dict[int, tuple[int, int]] | None:
        """offset -> (length, crc) of segment num's side file (None: there is none)."""
        try:
            with open(self.file_name(num), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        found: dict[int, tuple[int, int]] = {}
        skip = HEADER.size if data.startswith(MAGIC) else 0  # a side file made before headers has none
        if skip > len(data):
            return found  # a torn header: nothing after it was written
        # whole entries after the header (a torn header or entry: none past it; never a slice whose end is
        # before its start, which compiled code refuses)
        end = skip + max(0, len(data) - skip) // ENTRY.size * ENTRY.size
        for offset, length, crc in ENTRY.iter_unpack(data[skip:end]):
            if length:
                found[offset] = (length, crc)
        return found

    def verified_end(self, path: str, num: int, pos: int, size: int, *, required: bool = True) -> tuple[int, str]:
        """Where the batches of segment num (the file `path`, `size` bytes) from `pos` on stop matching
        their entries, and why ("" when they run to `size`). Not `required`: a segment without a side file
        is not checked (a log without metadata: ours if it has side files, else Go's)."""
        if pos >= size:
            return pos, ""
        entries = self._entries(num)
        if entries is None:
            return (pos, f"no checksum: no {self.file_name(num)}") if required else (size, "")
        at = pos
        with open(path, "rb", buffering=0) as fh:
            while at < size:
                entry = entries.get(at)
                if entry is None:
                    return at, "no checksum covers it"
                length, crc = entry
                if at + length > size:
                    return at, f"its batch torn: {size - at} of {length} bytes"
                fh.seek(at)
                got = 0
                left = length
                while left > 0:
                    block = fh.read(min(_READ_BLOCK, left))
                    if not block:
                        return at, "its batch torn"
                    got = zlib.crc32(block, got)
                    left -= len(block)
                if got != crc:
                    return at, f"its batch fails its checksum: {got:08x}, {crc:08x} written"
                at += length
        return at, ""

    # --- removing -----------------------------------------------------------------------------

    def remove_below(self, first: int, names: Iterable[str]) -> None:
        """Side files of segments below the first one kept (a crash, or Go nsqd, removed the segments)."""
        for num in side_numbers(names, f"{self.name}.diskqueue"):
            if num >= first:
                break
            if num == self._num:
                self.close()
            remove_quietly(self.file_name(num))
