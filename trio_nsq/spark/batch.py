"""The batch read `spark.read.format("nsq")`: what a channel holds now, up to `max_messages` (and
`max_bytes`), in executor tasks; each message is FIN'd once Spark has taken every row of its task.

Who calls it: Spark. `partitions()` on the driver when the read is planned (the brokers, from the list
or from lookupd's /lookup, each split into `partitions_per_broker` tasks sharing its part of
`max_messages`); `read()` in an executor task, once per partition.

Why FIN in the task: PySpark's batch reader has no commit, no call on the driver after the job. The
latest point a task can see is the end of its own rows: the generator resumes after its last `yield`
only when Spark asks for more, so every row has been taken. A task that fails or is killed before that
FINs nothing: its messages are REQ'd when the task can still say so, and otherwise come back once
msg_timeout has passed since the connection closed. What a later stage does with the rows is past that
point: a job that fails after the read tasks ended does not bring the messages back (a streaming query
with `trigger(availableNow=True)` does: its FIN follows the commit).
"""

from __future__ import annotations

import json
import logging
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace

from pyspark.sql.datasource import DataSourceReader, InputPartition

from trio_nsq.shared.addresses import join_host_port
from trio_nsq.spark.source import ReadSettings, to_record_batch

log = logging.getLogger("trio_nsq.spark")


@dataclass(frozen=True)
class BrokerShare(InputPartition):
    """One task's part: a broker, and how many messages it may take from it."""

    address: str
    max_messages: int
    max_bytes: int


def lookup_tcp_addresses(lookupds: tuple[str, ...], topic: str, timeout: float = 10.0) -> list[str]:
    """The TCP addresses lookupd lists for `topic` (its /lookup), over every lookupd that answers."""
    found: list[str] = []
    for lookupd in lookupds:
        base = lookupd.rstrip("/") if "://" in lookupd else f"http://{lookupd}"
        url = f"{base}/lookup?{urllib.parse.urlencode({'topic': topic})}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                data = json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:  # 404: lookupd does not know the topic
                log.warning("nsq read: lookupd %s answered %d", lookupd, exc.code)
            continue
        except (OSError, ValueError) as exc:
            log.warning("nsq read: lookupd %s unreachable - %s", lookupd, exc)
            continue
        data = data.get("data", data)
        for producer in data.get("producers") or []:
            found.append(join_host_port(producer["broadcast_address"], int(producer["tcp_port"])))
    return list(dict.fromkeys(found))


class NSQBatchReader(DataSourceReader):
    def __init__(self, settings: ReadSettings, max_messages: int, max_bytes: int, partitions_per_broker: int,
                 idle_timeout: float) -> None:
        self.settings = settings
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.partitions_per_broker = partitions_per_broker
        self.idle_timeout = idle_timeout  # seconds without a message after which a broker is drained

    def partitions(self) -> list[BrokerShare]:
        s = self.settings
        brokers = list(dict.fromkeys(s.nsqd_tcp_addresses + tuple(
            lookup_tcp_addresses(s.lookupd_http_addresses, s.topic) if s.lookupd_http_addresses else ())))
        if not brokers:  # only lookupd, and it knows no broker with the topic: nothing to read
            return [BrokerShare("", 0, 0)]
        parts = len(brokers) * self.partitions_per_broker
        base, extra = divmod(self.max_messages, parts)
        shares = [BrokerShare(brokers[i % len(brokers)], base + (1 if i < extra else 0),
                              max(1, self.max_bytes // parts)) for i in range(parts)]
        return [share for share in shares if share.max_messages] or [BrokerShare("", 0, 0)]

    def read(self, partition: InputPartition) -> Iterator:
        assert isinstance(partition, BrokerShare)
        if not partition.max_messages:
            return
        from trio_nsq.spark.fetcher import Fetcher

        # RDY over this task's connections is its share: nsqd sends no more than that
        settings = replace(self.settings, nsqd_tcp_addresses=(partition.address,), lookupd_http_addresses=(),
                           max_in_flight=partition.max_messages, max_messages_per_batch=partition.max_messages,
                           max_bytes_per_batch=partition.max_bytes)
        fetcher = Fetcher(settings)
        done = False
        try:
            self._wait_drained(fetcher, partition)
            fetcher.call(fetcher.stop_delivery)  # before the FINs, which would make room for more
            messages = fetcher.call(fetcher.take, 1)
            if messages:
                yield to_record_batch(settings, messages)
            # resumed: Spark has taken every row of this task
            fetcher.call(fetcher.commit, 1)
            done = True
        finally:
            # not done (the task failed, was killed, or Spark stopped reading early): REQ what was held
            fetcher.close(requeue_held=not done)

    def _wait_drained(self, fetcher, partition: BrokerShare) -> None:
        """Until the share has arrived, or no message came for idle_timeout once connected."""
        # to connect (the Fetcher retries with backoff meanwhile)
        if not fetcher.wait_connected(timeout=30.0):
            raise ConnectionError(f"nsq read: cannot connect to {partition.address} (see the log)")
        fetcher.wait_settled(partition.max_messages, quiet=self.idle_timeout)
