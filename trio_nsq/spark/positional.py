"""The positional reader: `spark.readStream.format("nsq")` and `spark.read.format("nsq")` reading a topic's
log by position on trio-nsqd (its /log API, log_client.py), the way Spark reads Kafka.

Offsets are positions: `{"<topic>": {"<broker http address>": {"log_id": "<hex>", "position": <int>}}}`,
one position per broker, keys sorted (Spark compares offsets as JSON strings). A position is a byte offset
in the broker's log of the topic, and `log_id` names that log (a topic deleted and made again, or a data
directory replaced, has another). A broker is its log: two addresses answering with one log id
(127.0.0.1:4151 and localhost:4151) are one broker, read once; the key is only where it was reached. So
are a replicated topic's replicas (cluster mode, issue 52: one log id, the same positions): its ranges are
read at each of them in turn (Planner.spread), its cursor committed on its leader.
Nothing but offsets passes through the driver: each task reads its range, [start, end) of one broker,
from the broker itself, so a range read again gives the same rows.

Who calls what (Spark):
- `NSQLogStreamReader`: `initialOffset`, `latestOffset`, `reportLatestOffset`, `partitions`, `commit`,
  `prepareForTriggerAvailableNow`, `stop` on the driver, in the one Python process Spark keeps for the
  query's source; `read` in executor tasks. The query's place is its checkpoint's offsets, as with Kafka.
  With the `channel` option the reader also keeps one durable cursor per broker: a channel the broker
  moves with `POST /log/commit`, which pins the log's retention from there and shows the query's lag as
  its depth. It moves when Spark commits a micro-batch, and to the checkpoint's start when a query
  restarts.
- `NSQLogBatchReader`: `partitions` on the driver when the read is planned, `read` in tasks.

Both are made in datasource.py (`mode`). Their options (Kafka's names where Kafka has the concept) are
checked at planning time by options.log_settings.
"""

from __future__ import annotations

import array
import functools
import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from time import monotonic, sleep

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType, TimestampType

from trio_nsq.spark.log_client import (
    LogAPIError,
    LogClient,
    LogUnavailableError,
    Positions,
    ReadResult,
    lookup_http_addresses,
)
from trio_nsq.spark.options import EARLIEST, LATEST, LogSettings

LOG_SCHEMA = StructType([
    StructField("value", BinaryType(), False),
    StructField("topic", StringType(), False),
    StructField("position", LongType(), False),
    StructField("id", StringType(), False),
    StructField("timestamp", TimestampType(), False),
    StructField("nsqd_address", StringType(), False),
    StructField("deadline", TimestampType(), True),
])

# a record in the log: [size int32 BE][timestamp ns int64 BE][attempts uint16 BE][id: 16 ASCII hex][body]
TIMESTAMP_AT, ID_AT, BODY_AT = 4, 14, 30

# --- offsets ---------------------------------------------------------------------------------------

Cursor = tuple[str, int]  # (log_id, position)


# what the broker answers a commit to a channel that is not a query's cursor (broker/http/log_api.py)
NOT_A_CURSOR = ("CHANNEL_HAS_CONSUMERS", "CHANNEL_NOT_A_CURSOR")


def offsets_dict(topic: str, cursors: dict[str, Cursor], waiting: Iterable[str] = ()) -> dict:
    """The offset Spark keeps: {topic: {broker: {"log_id", "position"}}}, every key in sorted order
    (json.dumps keeps the order, and Spark compares offsets as strings). A broker is known by its log id;
    its key is the address it was last reached at. `waiting`: brokers that did not answer when the query
    started, with {"log_id": null, "position": null}: they join where the options say when they answer."""
    entries = {broker: {"log_id": log_id, "position": position} for broker, (log_id, position) in cursors.items()}
    entries.update({broker: {"log_id": None, "position": None} for broker in waiting if broker not in cursors})
    return {topic: {broker: entries[broker] for broker in sorted(entries)}}


def offsets_json(offsets: dict) -> str:
    return json.dumps(offsets)  # as PySpark's source runner writes them


def parse_offsets(topic: str, offsets: dict) -> dict[str, Cursor]:
    """An offset Spark hands back -> broker -> (log_id, position), the brokers still waiting left out."""
    return _parse(topic, offsets)[0]


def _parse(topic: str, offsets: dict) -> tuple[dict[str, Cursor], list[str]]:
    """An offset Spark hands back -> (broker -> (log_id, position); the brokers waiting to join)."""
    brokers = offsets.get(topic)
    if not isinstance(brokers, dict):
        raise ValueError(f"nsq: the offset {offsets_json(offsets)} is not of topic {topic!r}: this checkpoint "
                         "belongs to another query (or topic); start it with a new checkpoint location")
    cursors = {broker: (str(c["log_id"]), int(c["position"])) for broker, c in brokers.items()
               if c.get("log_id") is not None}
    return cursors, sorted(broker for broker in brokers if broker not in cursors)


def by_log(cursors: dict[str, Cursor]) -> dict[str, tuple[str, int]]:
    """broker -> (log_id, position) as log_id -> (broker, position). An offset written before brokers were
    known by their log may name one log under two addresses (read twice then): the lower position wins, so
    nothing is skipped."""
    logs: dict[str, tuple[str, int]] = {}
    for broker, (log_id, position) in sorted(cursors.items()):
        if log_id not in logs or position < logs[log_id][1]:
            logs[log_id] = (broker, position)
    return logs


def _named(positions: dict, broker: str, aliases: Sequence[str]) -> str | None:
    """The key a JSON offsets option gives `broker` under (its address or another of its log's), or None."""
    return next((a for a in [broker, *aliases] if a in positions), None)


def share(limit: int, backlogs: dict[str, int]) -> dict[str, int]:
    """`limit` shared over the brokers in proportion to their backlogs, as Kafka shares maxOffsetsPerTrigger
    over partitions: a share below 1 is rounded up to 1 (so no broker with a backlog waits while the others
    keep theirs above the limit; the shares may then sum to a little more than `limit`), the rest by largest
    remainder, none above its backlog; ties go to the first broker in sorted order, so the same backlogs give
    the same shares."""
    total = sum(b for b in backlogs.values() if b > 0)
    if total <= limit:
        return {broker: max(0, b) for broker, b in backlogs.items()}
    shares: dict[str, int] = {}
    remainders = []
    for broker in sorted(backlogs):
        backlog = max(0, backlogs[broker])
        whole, rest = divmod(limit * backlog, total)
        shares[broker] = max(whole, 1) if backlog else 0
        if whole:
            remainders.append((-rest, broker))
    left = limit - sum(shares.values())
    for _, broker in sorted(remainders)[:max(0, left)]:
        shares[broker] += 1
    return shares


# --- partitions and rows ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LogRange(InputPartition):
    """One task's part: records [start, end) of `topic`'s log `log_id` on broker `address` (the log's name in
    the offsets and the rows' `nsqd_address`). `replicas`: where the task reads it, in order (the next when
    one does not answer or serves nothing there): addresses that answered with the same log id, each
    serving past `end` when the range was planned (a cluster's replicas, Planner.spread); empty: `address`."""

    address: str
    topic: str
    log_id: str
    start: int
    end: int
    replicas: tuple[str, ...] = ()


def arrow_schema():
    import pyarrow as pa

    stamp = pa.timestamp("us", tz="UTC")
    return pa.schema([
        pa.field("value", pa.binary(), False), pa.field("topic", pa.string(), False),
        pa.field("position", pa.int64(), False), pa.field("id", pa.string(), False),
        pa.field("timestamp", stamp, False), pa.field("nsqd_address", pa.string(), False),
        pa.field("deadline", stamp, True)])


def record_batch(topic: str, address: str, result: ReadResult):
    """The records of one /log/read as one Arrow record batch of LOG_SCHEMA, cut column-wise out of the body
    (its offsets trailer gives each record's start: they are the binary column's offsets): no Python work
    per record."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n, size, body = result.records, result.records_bytes, result.body
    # (the trailers are copied: their place in the body is not aligned for int32 / int64)
    offsets = pa.py_buffer(body[size:size + 4 * (n + 1)])
    records = pa.Array.from_buffers(pa.binary(), n, [None, offsets, pa.py_buffer(body)])

    def big_endian(start: int, code: str, arrow_type):
        """The fixed-width big-endian integer at `start` of every record, as an Arrow array."""
        values = array.array(code)
        width = values.itemsize
        column = pc.binary_slice(records, start, start + width).cast(pa.binary(width))
        values.frombytes(memoryview(column.buffers()[1])[:width * n])
        if sys.byteorder == "little":
            values.byteswap()
        return pa.Array.from_buffers(arrow_type, n, [None, pa.py_buffer(values)])

    def same(value: str):
        return pa.repeat(pa.scalar(value, pa.string()), n)

    stamp = pa.timestamp("us", tz="UTC")
    positions = pc.add(pa.Array.from_buffers(pa.int32(), n, [None, offsets]).cast(pa.int64()),
                       pa.scalar(result.position, pa.int64()))
    if result.deadlines:
        k = result.deadlines
        start = size + 4 * (n + 1)
        pairs = pa.Array.from_buffers(pa.int64(), 2 * k, [None, pa.py_buffer(body[start:start + 16 * k])])
        if sys.byteorder != "little":
            raise RuntimeError("nsq: reading deferred records' deadlines needs a little-endian machine")
        pairs = pa.FixedSizeListArray.from_arrays(pairs, 2)
        row_of = pc.index_in(positions, value_set=pc.list_element(pairs, 0))  # null: not deferred
        deadline = pc.take(pc.list_element(pairs, 1), row_of)
        deadline = pc.multiply(deadline, pa.scalar(1000, pa.int64())).cast(stamp)
    else:
        deadline = pa.nulls(n, stamp)
    return pa.record_batch([
        pc.binary_slice(records, BODY_AT, 2**31 - 1),  # (to each record's end)
        same(topic),
        positions,
        pc.binary_slice(records, ID_AT, BODY_AT).cast(pa.string()),  # ids are ASCII
        pc.divide(big_endian(TIMESTAMP_AT, "q", pa.int64()), 1000).cast(stamp),
        same(address),
        deadline,
    ], schema=arrow_schema())


# An empty read below a range's end: the broker answers without records it had synced when the range was
# planned. A broker that restarted (or came back from a copy of its data) may answer behind for a while:
# the task asks again after these pauses (about 28 s in all); still without them then, they are lost.
STALLED_PAUSES = (0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0)


def read_range(settings: LogSettings, part: InputPartition) -> Iterator:
    """A task's work: the records of `part` as Arrow record batches, one per /log/read, asking for its
    log id (a read never mixes two logs). The next read is on its way (a thread of its own) while Spark
    takes the batch before it. A range whose records are gone fails the task (failOnDataLoss), or goes on
    from the earliest record kept, with a warning. A broker that serves nothing where the range still has
    records is asked again after STALLED_PAUSES before that counts as records lost. A range with `replicas`
    turns to the next one instead, while one is left (they hold the same log)."""
    if not isinstance(part, LogRange):
        return  # Spark's placeholder for a read with no range
    from concurrent.futures import ThreadPoolExecutor

    position = part.start
    stalled = 0
    others = list(part.replicas[1:])  # the replicas still to turn to (the first is read first)

    def connect(address: str) -> LogClient:
        # (a replica with others behind it is given up sooner: they serve the same records)
        return LogClient(address, max_retries=2 if others else 8)

    client = connect(part.replicas[0] if part.replicas else part.address)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="nsq-read") as ahead:

            def fetch(at: int):
                return ahead.submit(client.read, part.topic, at, part.end, settings.read_max_bytes, part.log_id)

            def turn(why: str):
                """The next replica, asked from `position` (none is in flight on the client left)."""
                nonlocal client
                _log().warning("nsq: %s %s at position %d of %r (log %s): reading the range at %s", client.address,
                               why, position, part.topic, part.log_id, others[0])
                client.close()
                client = connect(others.pop(0))
                return fetch(position)

            pending = fetch(position)
            while pending is not None:
                try:
                    result = pending.result()
                except LogUnavailableError:
                    if not others:
                        raise
                    pending = turn("does not answer")
                    continue
                except LogAPIError as exc:
                    if exc.code != "POSITION_PAST_END" and others:  # (a replica that lost the topic, or its records)
                        pending = turn(f"answered {exc.status} {exc.code}")
                        continue
                    if exc.code == "POSITION_PAST_END":
                        result = None  # its durable tail is before `position` now: as an empty read
                    elif exc.code not in ("POSITION_GONE", "LOG_ID_MISMATCH", "TOPIC_NOT_FOUND"):
                        raise RuntimeError(f"nsq: reading {part.topic!r} on {client.address} at position "
                                           f"{position}: {exc.status} {exc.code}") from exc
                    else:
                        data_loss(settings, client.address, f"records from position {position} (log {part.log_id}) "
                                  f"to be there for this task's range [{part.start}, {part.end})", _lost_text(exc.code))
                        if exc.code != "POSITION_GONE":
                            return
                        try:
                            first = client.positions(part.topic)
                        except LogAPIError as gone:  # the topic went too, meanwhile
                            data_loss(settings, client.address, f"log {part.log_id}", _lost_text(gone.code))
                            return
                        if first.log_id != part.log_id:
                            return
                        position = first.first
                        pending = fetch(position) if position < part.end else None
                        continue
                if result is not None and (result.records or result.next_position > position):
                    following = max(position, result.next_position)
                    pending = fetch(following) if following < part.end else None
                    if result.records:
                        yield record_batch(part.topic, part.address, result)
                        stalled = 0
                    position = following
                    continue
                # nothing served at `position`, below the range's end
                if others:
                    pending = turn("serves nothing")
                    continue
                tail = "past it" if result is None else f"at {result.end}"
                if stalled == len(STALLED_PAUSES):
                    data_loss(settings, client.address, f"records from position {position} to {part.end} of log "
                              f"{part.log_id} (synced when this task's range was planned)",
                              f"it still serves none after {sum(STALLED_PAUSES):.0f} s (its durable tail is {tail})",
                              then="ending this task's range there")
                    return
                if not stalled:
                    _log().warning("nsq: %s serves nothing at position %d of %r (log %s; its durable tail is %s) "
                                   "below the range's end %d: asking again for up to %.0f s (a broker restarting)",
                                   client.address, position, part.topic, part.log_id, tail, part.end,
                                   sum(STALLED_PAUSES))
                sleep(STALLED_PAUSES[stalled])
                stalled += 1
                pending = fetch(position)
    finally:
        client.close()


def _lost_text(code: str) -> str:
    return {"POSITION_GONE": "they are gone (retention removed them)",
            "LOG_ID_MISMATCH": "the topic's log was replaced (deleted and made again, or another data directory)",
            "TOPIC_NOT_FOUND": "the topic is gone (deleted)"}.get(code, code)


class DataLossError(RuntimeError):
    """Records the query was to read are gone, and failOnDataLoss is true."""


def data_loss(settings: LogSettings, broker: str, expected: str, found: str,
              then: str = "going on from the earliest record kept") -> None:
    """Records to read are gone: raise (failOnDataLoss=true) or log a warning; the caller goes on as
    `then` says (from the earliest record kept, unless it says otherwise)."""
    text = (f"nsq: topic {settings.topic!r} on broker {broker}: expected {expected}, but {found}. Records may "
            "have been lost: they were not read before the broker removed them")
    if settings.fail_on_data_loss:
        raise DataLossError(text + ". To go on from the earliest record kept, set .option('failOnDataLoss', "
                                   "'false') (and restart the query from its checkpoint)")
    _log().warning("%s; failOnDataLoss=false: %s", text, then)


def _log() -> logging.Logger:
    """The logger, to stderr (the driver's console) when nobody configured logging, as in the Python
    processes Spark starts."""
    from trio_nsq.spark.datasource import _commit_log

    return _commit_log()


# --- the driver side, shared -----------------------------------------------------------------------


@dataclass
class Survey:
    """The topic's logs as the brokers asked now describe them. A broker is its log: two addresses that
    answer with one log id (127.0.0.1:4151 and localhost:4151) are one broker, read at one of them."""

    logs: dict[str, tuple[str, Positions]] = field(default_factory=dict)  # log id -> (address read, positions)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # log id -> every address that answered with it
    answered: dict[str, str | None] = field(default_factory=dict)  # address -> its log id (None: no such topic)
    down: list[str] = field(default_factory=list)  # addresses that did not answer


class Planner:
    """The driver's view of the brokers: one LogClient each (few retries, none for a broker already known
    not to answer: it keeps its offset and the micro-batch goes on without it), discovery, and the ranges
    and cuts of a read. Used by both readers."""

    def __init__(self, settings: LogSettings) -> None:
        self.settings = settings
        self.clients: dict[str, LogClient] = {}
        self.unreachable: set[str] = set()  # brokers logged as not answering (logged once until they answer)
        self.logs: dict[str, str | None] = {}  # broker -> the topic's log id last seen there (None: no topic)
        self.told: set[tuple[str, ...]] = set()  # addresses logged as one broker
        # log id -> address -> how far it served the log at the last survey (spread: where a range is read)
        self.served: dict[str, dict[str, int]] = {}
        self.turn = 0  # the next range's first replica, round-robin over the planner's life
        self.leaders: dict[str, str] = {}  # log id -> the address of it that leads it (cluster mode), for commits

    def client(self, broker: str) -> LogClient:
        if broker not in self.clients:
            self.clients[broker] = LogClient(broker, timeout=10.0, max_retries=2, retry_backoff=0.1)
        # a broker that did not answer is asked once per micro-batch, not three times
        self.clients[broker].max_retries = 0 if broker in self.unreachable else 2
        return self.clients[broker]

    def survey(self, addresses: Iterable[str], prefer: Iterable[str] = ()) -> Survey:
        """Ask each address for the topic's log; group them by log id. A log reached at several addresses
        is read at the first of them in `prefer` (where the offsets know it), else the first asked."""
        found = Survey()
        seen: dict[str, Positions] = {}
        for address in dict.fromkeys(addresses):
            try:
                now = self.positions(address)
            except LogUnavailableError:
                found.down.append(address)
                continue
            found.answered[address] = None if now is None else now.log_id
            if now is not None:
                found.aliases.setdefault(now.log_id, []).append(address)
                seen[address] = now
        preferred = list(prefer)
        for log_id, names in found.aliases.items():
            chosen = next((a for a in preferred if a in names), names[0])
            found.logs[log_id] = (chosen, seen[chosen])
            self.served[log_id] = {a: seen[a].end for a in names}
            if len(names) > 1 and self.settings.channel is not None:
                self.find_leader(log_id, names)
            if len(names) > 1 and tuple(names) not in self.told:
                self.told.add(tuple(names))
                _log().info("nsq: %s are one broker (topic %r's log %s): it is read once, at %s",
                            " and ".join(names), self.settings.topic, log_id, chosen)
        return found

    def find_leader(self, log_id: str, names: Sequence[str]) -> None:
        """Which of a replicated log's addresses leads it: the query's cursor is committed there (a follower
        mirrors its leader's channels and deletes the others: a cursor committed on it would not last)."""
        for address in sorted(names, key=lambda a: a != self.leaders.get(log_id)):  # (the last one first)
            try:
                if self.client(address).role(self.settings.topic) == "leader":
                    self.leaders[log_id] = address
                    return
            except (LogAPIError, LogUnavailableError):
                continue
        self.leaders.pop(log_id, None)

    def check_named(self, name: str, named: dict, found: Survey) -> None:
        """A JSON offsets option (`named`, by address) must give every broker a position: each log by one of
        its addresses, and each broker that did not answer (it may be any broker); else ValueError."""
        missing = [found.logs[log_id][0] for log_id, names in sorted(found.aliases.items())
                   if not any(a in named for a in names)]
        missing += [a for a in found.down if a not in named]
        if missing:
            raise ValueError(f"nsq: option {name} gives no position for broker {', '.join(sorted(missing))} of "
                             f"topic {self.settings.topic!r}: name every broker (a position, -2 for earliest, -1 "
                             "for latest), as Kafka's source asks for every TopicPartition")

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.clients.clear()

    def brokers(self) -> list[str]:
        """The configured brokers, those of JSON offsets options, and lookupd's for the topic."""
        s = self.settings
        found = list(s.addresses) + list(s.starting_positions) + list(s.ending_positions)
        if s.lookupds:
            producers, failed = lookup_http_addresses(s.lookupds, s.topic)
            found += producers
            for failure in failed:
                self.not_answering(f"lookupd {failure}")
        return list(dict.fromkeys(found))

    def not_answering(self, broker: str, error: object = "") -> None:
        if broker not in self.unreachable:
            self.unreachable.add(broker)
            _log().warning("nsq: %s does not answer (%s); its offset stays as it is until it does (not a loss "
                           "of data)", broker, error)

    def answering(self, broker: str) -> None:
        if broker in self.unreachable:
            self.unreachable.discard(broker)
            _log().info("nsq: %s answers again", broker)

    def positions(self, broker: str) -> Positions | None:
        """The broker's /log/positions; None when the topic does not exist there (404 TOPIC_NOT_FOUND).
        LogUnavailableError when it does not answer; a broker without the /log API is an error."""
        try:
            found = self.client(broker).positions(self.settings.topic)
        except LogAPIError as exc:
            if exc.code == "TOPIC_NOT_FOUND":
                self.answering(broker)
                self.logs[broker] = None
                return None
            raise self.api_error(exc) from exc
        except LogUnavailableError as exc:
            self.not_answering(broker, exc)
            raise
        self.answering(broker)
        self.logs[broker] = found.log_id
        return found

    def api_error(self, exc: LogAPIError) -> Exception:
        """An answer the reader cannot go on from, as a sentence a Spark user can act on."""
        if exc.code == "TOPIC_HAS_NO_LOG":
            return RuntimeError(f"nsq: topic {self.settings.topic!r} keeps no log on {exc.address} (an ephemeral "
                                "topic): read it with mode=channel")
        if exc.status == 404 and exc.code in ("NOT_FOUND", "404 page not found", ""):
            return RuntimeError(f"nsq: {exc.address} has no /log API ({exc.request} answered {exc.status} "
                                f"{exc.code}): it is Go nsqd, or a trio-nsqd without it; read it with mode=channel")
        return RuntimeError(f"nsq: {exc}")

    def start_position(self, broker: str, now: Positions, aliases: Sequence[str] = ()) -> int:
        """Where the options say a read starts on `broker`, whose log is `now`, also known as `aliases`
        (data loss handled)."""
        s = self.settings
        client = self.client(broker)
        if s.starting_timestamp is not None:
            return client.position_at(s.topic, s.starting_timestamp).position
        if s.starting == "latest":
            return now.end
        named = _named(s.starting_positions, broker, aliases)
        if s.starting != "json" or named is None:
            return now.first  # earliest; or a broker the JSON does not name (as one appearing later)
        log_id, position = s.starting_positions[named]
        if position == EARLIEST:
            return now.first
        if position == LATEST:
            return now.end
        if log_id is not None and log_id != now.log_id:
            data_loss(s, broker, f"log {log_id} (startingOffsets)", f"the topic's log is now {now.log_id}: "
                      + _lost_text("LOG_ID_MISMATCH"))
            return now.first
        if position < now.first:
            data_loss(s, broker, f"position {position} (startingOffsets) to be kept", f"the first record kept is "
                      f"at {now.first}")
            return now.first
        return self.checked(broker, "startingOffsets", position, now)

    def checked(self, broker: str, option: str, position: int, now: Positions) -> int:
        """`position`, from an option, if it is a record boundary within the log; else ValueError."""
        if position > now.end:
            raise ValueError(f"nsq: {option}: position {position} on {broker} is past the end of topic "
                             f"{self.settings.topic!r}'s log there ({now.end})")
        try:
            self.client(broker).position_after(self.settings.topic, position)
        except LogAPIError as exc:
            if exc.code == "POSITION_NOT_A_RECORD":
                raise ValueError(f"nsq: {option}: position {position} on {broker} is not where a record starts: "
                                 "take positions from a query's offsets or a `position` column") from None
            raise self.api_error(exc) from exc
        return position

    def spread(self, ranges: list[LogRange]) -> list[LogRange]:
        """Each range read at the addresses its log answered at in the last survey that served past its end
        (a cluster's replicas: same log id, same positions; a follower serves up to the high watermark it
        was told, which may lag the leader's by a fetch, so one that served less is left out), starting
        round-robin: the ranges' reads go to every replica. The offsets and `address` (the rows'
        `nsqd_address`) stay the log's name; a log reached at one address is read there, as before."""
        out = []
        for r in ranges:
            served = self.served.get(r.log_id, {})
            fit = sorted(a for a, end in served.items() if end >= r.end)
            if not fit or fit == [r.address]:
                out.append(r)
                continue
            first = self.turn % len(fit)
            self.turn += 1
            order = fit[first:] + fit[:first]
            if r.address not in order:  # (it named the log when it was planned: the last resort)
                order.append(r.address)
            out.append(replace(r, replicas=tuple(order)))
        return out

    def cut(self, ranges: list[LogRange]) -> list[LogRange]:
        """The ranges as the read's partitions: as they are, or, when minPartitions asks for more, the
        largest cut first at the record boundaries the broker proposes (/log/splits). The same ranges give
        the same cuts."""
        wanted = self.settings.min_partitions or 0
        # a range larger than max_bytes_per_partition gets a task each that many bytes (tasks side by side
        # on the executors' cores, rather than one reading it all), then minPartitions adds more
        most = self.settings.max_bytes_per_partition
        parts = [max(1, -(-(r.end - r.start) // most)) for r in ranges]
        if sum(parts) >= wanted and parts == [1] * len(ranges) or not ranges:
            return ranges
        for _ in range(max(0, wanted - sum(parts))):
            # the range with the most bytes per part gets one more part (ties: the first)
            i = max(range(len(ranges)), key=lambda j: ((ranges[j].end - ranges[j].start) / parts[j], -j))
            parts[i] += 1
        out: list[LogRange] = []
        for r, n in zip(ranges, parts):
            cuts: list[int] = []
            if n > 1:
                try:
                    log_id, cuts = self.client(r.address).splits(r.topic, r.start, r.end, n)
                    if log_id != r.log_id:
                        cuts = []
                except (LogAPIError, LogUnavailableError) as exc:
                    _log().warning("nsq: cannot cut %s's range [%d, %d) in %d parts (%s): one task reads it",
                                   r.address, r.start, r.end, n, exc)
            bounds = [r.start] + [c for c in cuts if r.start < c < r.end] + [r.end]
            out += [LogRange(r.address, r.topic, r.log_id, a, b) for a, b in zip(bounds, bounds[1:])]
        return out


# --- the stream reader -----------------------------------------------------------------------------


class NSQLogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """spark.readStream by position. Spark calls `initialOffset`, `latestOffset`, `reportLatestOffset`,
    `partitions`, `commit` and `prepareForTriggerAvailableNow` on the driver, in the one Python process it
    keeps for the source (the state below lives there); `read` in executor tasks, on a pickled copy made
    when the query was planned (so __init__ asks no broker).

    Without the `channel` option nothing is kept on the brokers: the query's place is its checkpoint's
    offsets (as with Kafka), and records retention removed before they were read are reported by
    failOnDataLoss. With it, a durable cursor per broker follows Spark's commits (below)."""

    def __init__(self, settings: LogSettings) -> None:
        self.settings = settings
        self._planner: Planner | None = None
        self._initial: str | None = None  # initialOffset's answer (as JSON): the start of a new query
        self._reconciled = False  # the cursors were moved to a start Spark gave (a restart), or committed
        self._target: dict[str, int] | None = None  # Trigger.AvailableNow: log id -> where to stop
        self._latest: dict | None = None  # the logs' ends last seen (reportLatestOffset)
        self._last_trigger: float | None = None  # when minOffsetsPerTrigger last let a micro-batch go (s)
        self._down_since: dict[str, float] = {}  # broker -> since when it has not answered (s)
        self._gone: dict[str, float] = {}  # broker -> when it left the query (broker_gone_timeout)
        self._left: dict[str, int] = {}  # log id -> the position it left the query at (if it comes back)
        self.clock = monotonic

    @property
    def planner(self) -> Planner:
        if self._planner is None:
            self._planner = Planner(self.settings)
        return self._planner

    def _start(self, start: dict) -> tuple[dict[str, Cursor], list[str]]:
        """`start` parsed. The first start Spark hands this reader, when it is not initialOffset's answer,
        is a query restarted from its checkpoint (Spark calls latestOffset or partitions first then): the
        cursors go back (or on) to it, so the log is kept from there and the lag shown is the query's."""
        begin, waiting = _parse(self.settings.topic, start)
        if not self._reconciled:
            self._reconciled = True
            if offsets_json(start) != self._initial and self.settings.channel is not None:
                for broker in sorted(begin):
                    try:
                        self.planner.positions(broker)  # (a topic gone or made again is not committed to)
                    except LogUnavailableError:
                        pass
                moved = self._commit(begin)
                _log().info("nsq: the query restarts from %s: cursor %r set there on %s", offsets_json(start),
                            self.settings.channel, ", ".join(moved) or "no broker")
        return begin, waiting

    def _commit(self, cursors: dict[str, Cursor]) -> list[str]:
        """Move the cursor (when there is one) to `cursors` on each broker; the brokers where it moved."""
        s = self.settings
        if s.channel is None:
            return []
        moved = []
        for broker, (log_id, position) in sorted(cursors.items()):
            if self.planner.logs.get(broker, log_id) != log_id:
                # the topic is gone there, or has another log: a commit would make the topic again
                continue
            at = self.planner.leaders.get(log_id, broker)  # (a replicated log's cursor is on its leader)
            try:
                self.planner.client(at).commit(s.topic, s.channel, position, log_id)
                self.planner.answering(at)
                moved.append(at)
            except LogUnavailableError as exc:
                self.planner.not_answering(at, exc)
            except LogAPIError as exc:
                if exc.code in NOT_A_CURSOR:
                    # a consumer's channel: the broker will never move it (a seek would drop its messages)
                    raise RuntimeError(
                        f"nsq: channel {s.channel!r} of topic {s.topic!r} on {at} is not a cursor "
                        f"({exc.code}: a consumer's channel, made by SUB or /channel/create): give the query "
                        f"another `channel`; a cursor an older trio-nsq made is adopted once by POST "
                        f"/log/commit?topic={s.topic}&channel={s.channel}&position={position}&adopt=true") from None
                # the log changed or lost records: the next latestOffset says so (failOnDataLoss)
                _log().warning("nsq: cursor %r on %s not moved to %d: %s %s", s.channel, at, position,
                               exc.status, exc.code)
        return moved

    def initialOffset(self) -> dict:
        """Where a new query starts on every broker (startingTimestamp, else startingOffsets), and its
        cursors set there. Spark asks twice for the first micro-batch (planning it, then running it): the
        first answer is kept and given again, so the two agree and no record falls between them. A broker
        that does not answer waits in the offset, and joins where the options say when it answers; one
        without the topic yet joins later from its earliest record."""
        if self._initial is not None:
            return json.loads(self._initial)
        s = self.settings
        found = self.planner.survey(self.planner.brokers())
        if s.starting == "json" and s.starting_timestamp is None:
            self.planner.check_named("startingOffsets", s.starting_positions, found)
        cursors = {address: (log_id, self.planner.start_position(address, now, found.aliases[log_id]))
                   for log_id, (address, now) in found.logs.items()}
        self._commit(cursors)
        initial = offsets_dict(s.topic, cursors, found.down)
        self._initial = offsets_json(initial)
        return initial

    def getDefaultReadLimit(self) -> ReadLimit:
        s = self.settings
        if s.min_records is not None:  # (the max options then apply too: see latestOffset)
            return ReadMinRows(s.min_records)
        if s.max_records is not None:
            return ReadMaxRows(s.max_records)
        if s.max_bytes is not None:
            return ReadMaxBytes(s.max_bytes)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: each log's end now is where the query stops."""
        found = self.planner.survey(self.planner.brokers())
        self._target = {log_id: now.end for log_id, (_, now) in found.logs.items()}

    def reportLatestOffset(self) -> dict | None:
        """The logs' ends seen by the last latestOffset, for the query's progress (`latestOffset`)."""
        return self._latest

    def _asked(self, addresses: Iterable[str]) -> list[str]:
        """`addresses` less those gone (broker_gone_timeout) and not due to be asked again."""
        now, every = self.clock(), self.settings.broker_gone_ms / 1000
        return [a for a in dict.fromkeys(addresses) if now - self._gone.get(a, now - every) >= every]

    def _down_for(self, broker: str) -> float:
        """Seconds `broker` has not answered for (0 the first time)."""
        return self.clock() - self._down_since.setdefault(broker, self.clock())

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        s = self.settings
        begin, waiting = self._start(start)
        known = by_log(begin)
        found = self.planner.survey(self._asked([*begin, *waiting, *self.planner.brokers()]),
                                    prefer=[known[log_id][0] for log_id in sorted(known)])
        for broker in found.answered:
            self._down_since.pop(broker, None)
            self._gone.pop(broker, None)
        for broker in found.down:
            if broker in self._gone:
                self._gone[broker] = self.clock()  # (asked again in one more period)
        cursors: dict[str, Cursor] = {}
        still: list[str] = []  # brokers still waiting to join
        pending: list[tuple[str, str, int, int, Positions]] = []  # broker, log id, from, up to, now
        gone = s.broker_gone_ms / 1000
        for log_id, (broker, position) in sorted(known.items()):
            if log_id in found.logs:
                continue
            if broker not in found.answered:  # it does not answer: its offset stays, for a time
                if self._down_for(broker) < gone:
                    cursors[broker] = (log_id, position)
                    continue
                self._gone[broker] = self.clock()
                self._left[log_id] = position
                data_loss(s, broker, f"log {log_id} from position {position} to be read", "the broker has not "
                          f"answered for {gone:g} s (broker_gone_timeout): it leaves the query")
            elif found.answered[broker] is None:
                data_loss(s, broker, f"log {log_id} up to position {position}", _lost_text("TOPIC_NOT_FOUND"))
            else:  # (the new log joins below, from its earliest record)
                data_loss(s, broker, f"log {log_id}", f"the topic's log is now {found.answered[broker]}: "
                          + _lost_text("LOG_ID_MISMATCH"))
        for broker in waiting:
            if broker in found.answered:
                continue  # it joins below (or is another name of a broker in the query)
            if self._down_for(broker) < gone:
                still.append(broker)
            else:
                self._gone[broker] = self.clock()
                _log().warning("nsq: %s, waiting to join the query since its start, has not answered for %g s "
                               "(broker_gone_timeout): it leaves the query; records it has are not read", broker, gone)
        for log_id, (broker, now) in sorted(found.logs.items()):
            cap = None if self._target is None else self._target.get(log_id)
            if self._target is not None and cap is None:
                if log_id in known:  # a log newer than Trigger.AvailableNow's start: not for this query
                    cursors[broker] = (log_id, known[log_id][1])
                continue
            if log_id not in known:
                names = found.aliases[log_id]
                if log_id in self._left:  # back after broker_gone_timeout: from where it left
                    joined = max(now.first, min(now.end, self._left.pop(log_id)))
                    _log().info("nsq: topic %r on %s is back: it joins the query again at %d", s.topic, broker,
                                joined)
                elif any(a in waiting for a in names):
                    joined = self.planner.start_position(broker, now, names)
                    _log().info("nsq: topic %r on %s joins the query at its requested start (%d)", s.topic,
                                broker, joined)
                else:
                    joined = now.first
                    _log().info("nsq: topic %r on %s joins the query from its earliest record (%d)", s.topic,
                                broker, joined)
                # this micro-batch reads nothing from it (its range starts in the next one): the ranges of
                # a micro-batch follow from its two offsets alone
                cursors[broker] = (log_id, joined)
                continue
            position = known[log_id][1]
            if position > now.end:
                _log().warning("nsq: %s's durable tail (%d) is behind the query's position %d in log %s: waiting "
                               "for it", broker, now.end, position, log_id)
                cursors[broker] = (log_id, position)
                continue
            origin = position
            if position < now.first:
                data_loss(s, broker, f"position {position} to be kept", f"the first record kept is at {now.first}")
                origin = now.first  # (the task skips what is gone)
            upto = now.end if cap is None else min(now.end, max(cap, origin))
            cursors[broker] = (log_id, origin)
            if upto > origin:
                pending.append((broker, log_id, origin, upto, now))
        self._latest = offsets_dict(s.topic, {broker: (log_id, now.end)
                                              for log_id, (broker, now) in found.logs.items()})

        rows = bytes_ = None
        # records per broker in `pending` (HTTP requests): asked once, by the first that needs them
        backlogs_now = functools.cache(lambda: self._backlogs(pending))
        if isinstance(limit, ReadMinRows):
            # (not under Trigger.AvailableNow, which Spark hands the default limit: it would wait for ever)
            if self._target is None and self._delayed(limit.min_rows, backlogs_now):
                return start  # (Spark runs no micro-batch for an offset that did not move)
            rows, bytes_ = s.max_records, s.max_bytes
        elif isinstance(limit, ReadMaxRows):
            rows, bytes_ = limit.max_rows, s.max_bytes
        elif isinstance(limit, ReadMaxBytes):
            rows, bytes_ = s.max_records, limit.max_bytes
        # ReadAllAvailable (as with Trigger.Once and AvailableNow): the options' limits do not apply
        if rows is None and bytes_ is None:
            for broker, log_id, _, upto, _ in pending:
                cursors[broker] = (log_id, upto)
        else:
            self._limited(pending, cursors, rows, bytes_, backlogs_now)
        return offsets_dict(s.topic, cursors, still)

    def _delayed(self, min_rows: int, backlogs: Callable[[], dict[str, int]]) -> bool:
        """minOffsetsPerTrigger, as Kafka's: wait while fewer records than that are new, unless
        maxTriggerDelay has passed since the last micro-batch went (the first goes at once)."""
        now = self.clock()
        if self._last_trigger is None or now - self._last_trigger >= self.settings.max_trigger_delay_ms / 1000:
            self._last_trigger = now
            return False
        if sum(backlogs().values()) < min_rows:
            return True
        self._last_trigger = now
        return False

    def _backlogs(self, pending: list[tuple[str, str, int, int, Positions]]) -> dict[str, int]:
        """broker -> records in its range [from, up to) (a broker that does not answer: none)."""
        backlogs = {}
        topic = self.settings.topic
        for broker, _, origin, upto, now in pending:
            client = self.planner.client(broker)
            try:
                first = now.first_index if origin == now.first else client.position_after(topic, origin).index
                last = now.end_index if upto == now.end else client.position_after(topic, upto).index
            except LogUnavailableError as exc:
                self.planner.not_answering(broker, exc)
                continue  # (no share: it stays where it is)
            backlogs[broker] = last - first
        return backlogs

    def _limited(self, pending: list[tuple[str, str, int, int, Positions]], cursors: dict[str, Cursor],
                 rows: int | None, bytes_: int | None, backlogs: Callable[[], dict[str, int]]) -> None:
        """Move each broker's cursor by its share of the limits, shared by backlog (records, bytes)."""
        topic = self.settings.topic
        byte_shares = share(bytes_, {b: upto - origin for b, _, origin, upto, _ in pending}) \
            if bytes_ is not None else {}
        row_shares = share(rows, backlogs()) if rows is not None else {}
        for broker, log_id, origin, upto, _ in pending:
            records, size = row_shares.get(broker), byte_shares.get(broker)
            if (rows is not None and not records) or size == 0:
                continue
            try:
                after = self.planner.client(broker).position_after(topic, origin, records=records, max_bytes=size)
            except LogUnavailableError as exc:
                self.planner.not_answering(broker, exc)
                continue
            if after.log_id == log_id:
                cursors[broker] = (log_id, max(origin, min(upto, after.position)))

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        begin = by_log(self._start(start)[0])
        stop = by_log(parse_offsets(self.settings.topic, end))
        ranges = [LogRange(broker, self.settings.topic, log_id, begin[log_id][1], position)
                  for log_id, (broker, position) in stop.items()
                  if log_id in begin and position > begin[log_id][1]]
        if any(r.log_id not in self.planner.served for r in ranges):
            # (a micro-batch replayed from the checkpoint: no survey since this process started)
            named = [broker for broker, _ in [*begin.values(), *stop.values()]]
            self.planner.survey(self._asked([*named, *self.planner.brokers()]))
        return self.planner.spread(self.planner.cut(sorted(ranges, key=lambda r: (r.address, r.log_id))))

    def read(self, partition: InputPartition) -> Iterator:
        return read_range(self.settings, partition)

    def commit(self, end: dict) -> None:
        """Spark has the micro-batches up to `end` in the sink and the checkpoint: the cursors (if any)
        move there."""
        self._reconciled = True
        self._commit(parse_offsets(self.settings.topic, end))

    def stop(self) -> None:
        """The cursors stay (a restart from the checkpoint goes on from them); only the connections close."""
        if self._planner is not None:
            self._planner.close()


# --- the batch reader ------------------------------------------------------------------------------


class NSQLogBatchReader(DataSourceReader):
    """spark.read by position: from startingOffsets/startingTimestamp (default earliest) to
    endingOffsets/endingTimestamp (default latest: each broker's durable tail when the read is planned).
    Spark calls `partitions` on the driver when it plans the read, `read` in executor tasks."""

    def __init__(self, settings: LogSettings) -> None:
        self.settings = settings

    def partitions(self) -> Sequence[InputPartition]:
        s = self.settings
        planner = Planner(s)
        try:
            found = planner.survey(sorted(planner.brokers()))
            if found.down:
                raise ConnectionError(f"nsq: cannot plan the read: {', '.join(found.down)} did not answer")
            for address, log_id in found.answered.items():
                if log_id is None and (address in s.starting_positions or address in s.ending_positions):
                    data_loss(s, address, "the topic (named in the offsets options)", _lost_text("TOPIC_NOT_FOUND"))
            if s.starting == "json" and s.starting_timestamp is None:
                planner.check_named("startingOffsets", s.starting_positions, found)
            if s.ending == "json" and s.ending_timestamp is None:
                planner.check_named("endingOffsets", s.ending_positions, found)
            ranges = []
            for log_id, (broker, now) in sorted(found.logs.items(), key=lambda item: item[1][0]):
                names = found.aliases[log_id]
                first = planner.start_position(broker, now, names)
                last = self._end_position(planner, broker, now, names)
                if last < first:
                    raise ValueError(f"nsq: on {broker}, the read would end ({last}) before it starts ({first}): "
                                     "check startingOffsets/startingTimestamp against endingOffsets/endingTimestamp")
                if last > first:
                    ranges.append(LogRange(broker, s.topic, now.log_id, first, last))
            return planner.spread(planner.cut(ranges))
        finally:
            planner.close()

    def _end_position(self, planner: Planner, broker: str, now: Positions, aliases: Sequence[str]) -> int:
        s = self.settings
        if s.ending_timestamp is not None:
            return planner.client(broker).position_at(s.topic, s.ending_timestamp).position
        named = _named(s.ending_positions, broker, aliases)
        if s.ending != "json" or named is None:
            return now.end
        log_id, position = s.ending_positions[named]
        if position == LATEST:
            return now.end
        if log_id is not None and log_id != now.log_id:
            data_loss(s, broker, f"log {log_id} (endingOffsets)", f"the topic's log is now {now.log_id}: "
                      + _lost_text("LOG_ID_MISMATCH"))
            return now.end
        return planner.checked(broker, "endingOffsets", position, now)

    def read(self, partition: InputPartition) -> Iterator:
        return read_range(self.settings, partition)
