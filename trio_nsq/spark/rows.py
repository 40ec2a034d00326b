"""Rows to NSQ messages, as Spark's Kafka sink turns rows into records, working on the Arrow record batches
Spark hands to a `DataSourceArrowWriter` (a column at a time where it can).

- A `value` column (string or binary) is the body, taken as bytes straight from the Arrow column.
- Without a `value` column the row is the body, as one JSON object (UTF-8, compact), shaped like
  Spark's `to_json(struct(*))`: binary as base64, dates and timestamps as ISO 8601, maps as objects,
  NaN/Infinity as strings. Nulls are kept as `null`.
- The topic is the `topic` option, else the row's `topic` column.
- `key_field` (JSON rows only) adds a field holding an idempotency key, "<write>/<partition>/<row>": the
  same rows get the same keys when Spark runs a task again or replays a micro-batch.
- `key_column` (the idempotency_key_column option) is read by `keys()` for the requests' keys, and left
  out of a JSON body: it names the row's source, it is not part of the message.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trio_nsq.shared.names import is_valid_topic_name

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str).encode


class NSQRowError(ValueError):
    """A row that cannot become an NSQ message (null or empty value, missing or invalid topic)."""


def _float(value: float | None) -> Any:
    if value is None or math.isfinite(value):
        return value
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")


def _converter(arrow_type: pa.DataType) -> Callable[[Any], Any] | None:
    """A function making a to_pylist() value JSON-ready, or None when json handles it as it is."""
    t = pa.types
    if t.is_integer(arrow_type) or t.is_boolean(arrow_type) or t.is_string(arrow_type) \
            or t.is_large_string(arrow_type) or t.is_null(arrow_type):
        return None
    if t.is_floating(arrow_type):
        return _float
    if t.is_binary(arrow_type) or t.is_large_binary(arrow_type) or t.is_fixed_size_binary(arrow_type):
        return lambda v: None if v is None else base64.b64encode(v).decode("ascii")
    if t.is_timestamp(arrow_type) or t.is_date(arrow_type) or t.is_time(arrow_type):
        return lambda v: None if v is None else v.isoformat()
    if t.is_decimal(arrow_type):
        return lambda v: None if v is None else (int(v) if v == v.to_integral_value() else float(v))
    if t.is_map(arrow_type):
        key, item = _converter(arrow_type.key_type), _converter(arrow_type.item_type)
        return lambda v: None if v is None else {
            str(key(k) if key else k): (item(x) if item else x) for k, x in v}
    if t.is_list(arrow_type) or t.is_large_list(arrow_type) or t.is_fixed_size_list(arrow_type):
        item = _converter(arrow_type.value_type)
        return None if item is None else (lambda v: None if v is None else [item(x) for x in v])
    if t.is_struct(arrow_type):
        fields = [(f.name, conv) for f in arrow_type if (conv := _converter(f.type)) is not None]
        if not fields:
            return None

        def struct(v: dict | None) -> dict | None:
            if v is None:
                return None
            for name, conv in fields:
                v[name] = conv(v[name])
            return v

        return struct
    return lambda v: None if v is None else str(v)  # intervals, durations...: as text


class RowConverter:
    """Turns one partition's Arrow record batches into (topic, body) pairs. Built in the task from plain
    settings; the per-schema converters are made on the first batch."""

    def __init__(self, *, topic: str | None, has_value: bool, key_field: str | None = None,
                 key_prefix: str = "", key_column: str | None = None) -> None:
        self.topic = topic
        self.has_value = has_value
        self.key_field = key_field
        self.key_prefix = key_prefix
        self.key_column = key_column
        self.row_index = 0  # rows seen so far in this partition
        self._json_fields: list[tuple[str, Callable[[Any], Any]]] | None = None

    def messages(self, record_batches: Iterable[pa.RecordBatch]) -> Iterator[tuple[str, bytes]]:
        for rb in record_batches:
            yield from self.convert(rb)

    def convert(self, rb: pa.RecordBatch) -> Iterator[tuple[str, bytes]]:
        """The (topic, body) pairs of one record batch. If a row cannot be a message, NSQRowError comes
        on the first iteration, before any pair: nothing of that record batch is sent."""
        if not rb.num_rows:
            return iter(())
        return self._batch(rb)

    def keys(self, rb: pa.RecordBatch) -> list:
        """The key_column's values of one record batch (str or int), before its messages are made (call it
        first: convert() counts the rows); NSQRowError for a null, as nothing could key that row."""
        assert self.key_column is not None
        column = rb.column(rb.schema.get_field_index(self.key_column))
        if column.null_count:
            row = column.is_null().to_pylist().index(True)
            raise NSQRowError(f"nsq: row {self.row_index + row} of this partition has a null in its "
                              f"idempotency_key_column {self.key_column!r}: every row needs the key of its source. "
                              f"Filter such rows out, or fill the column (coalesce)")
        return column.to_pylist()

    def _batch(self, rb: pa.RecordBatch) -> Iterator[tuple[str, bytes]]:
        first = self.row_index
        bodies = self._values(rb, first) if self.has_value else self._json(rb, first)
        self.row_index += rb.num_rows
        if self.topic is not None:
            topic = self.topic
            for body in bodies:
                yield topic, body
            return
        topics = rb.column(rb.schema.get_field_index("topic")).to_pylist()
        for name in set(topics):
            if name is None or not is_valid_topic_name(name):
                row = first + topics.index(name)
                what = "a null topic" if name is None else f"the invalid topic {name!r}"
                raise NSQRowError(f"nsq: row {row} of this partition has {what} in its 'topic' column; topic names "
                                  "are 1-64 characters of [.a-zA-Z0-9_-], optionally ending in #ephemeral. Filter "
                                  "such rows out, or set .option('topic', ...)")
        yield from zip(topics, bodies, strict=True)

    @staticmethod
    def _values(rb: pa.RecordBatch, first: int) -> list[bytes]:
        column = rb.column(rb.schema.get_field_index("value"))
        if pa.types.is_string(column.type):
            column = column.cast(pa.binary())  # zero copy: the same UTF-8 bytes
        elif pa.types.is_large_string(column.type):
            column = column.cast(pa.large_binary())
        lengths = pc.binary_length(column)
        if column.null_count or pc.min(lengths).as_py() == 0:
            bad = pc.or_kleene(pc.is_null(column), pc.equal(lengths, 0)).to_pylist()
            row = bad.index(True)
            what = "a null" if column[row].as_py() is None else "an empty"
            raise NSQRowError(f"nsq: row {first + row} of this partition has {what} 'value'; NSQ messages cannot "
                              "be empty. Filter such rows out, e.g. .where(\"value IS NOT NULL AND value != ''\")")
        return column.to_pylist()

    def _json(self, rb: pa.RecordBatch, first: int) -> list[bytes]:
        if self.key_column is not None:
            rb = rb.drop_columns([self.key_column])
        if self._json_fields is None:
            fields = [(f.name, _converter(f.type)) for f in rb.schema]
            self._json_fields = [(name, conv) for name, conv in fields if conv is not None]
        rows = rb.to_pylist()
        for name, conv in self._json_fields:
            for row in rows:
                row[name] = conv(row[name])
        if self.key_field:
            key, prefix = self.key_field, self.key_prefix
            for i, row in enumerate(rows, first):
                row[key] = f"{prefix}/{i}"
        return [_dumps(row).encode() for row in rows]
