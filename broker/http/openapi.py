"""GET /openapi.json: an OpenAPI 3 description of nsqd's HTTP API (ours; Go nsqd has none)."""

from __future__ import annotations

import functools
from typing import Any

from trio_nsq.shared.http_api import go_json
from trio_nsq.shared.logs import GO_LOG_LEVELS
from trio_nsq.shared.version import VERSION


@functools.cache
def openapi_bytes() -> bytes:
    return go_json(openapi_spec())


def _param(name: str, description: str, *, required: bool = False, schema: dict | None = None) -> dict:
    return {"name": name, "in": "query", "required": required, "description": description,
            "schema": schema or {"type": "string"}}


def _err(*messages: str) -> dict:
    return {
        "description": " | ".join(messages),
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"},
                                         "examples": {m: {"value": {"message": m}} for m in messages}}},
    }


_TEXT_OK = {"description": "OK", "content": {"text/plain": {"schema": {"type": "string", "example": "OK"}}}}
_EMPTY_OK = {"description": "Done (empty body)"}
_TOPIC = _param("topic", "topic name: [.a-zA-Z0-9_-]+(#ephemeral)?, 1-64 characters", required=True)
_CHANNEL = _param("channel", "channel name: [.a-zA-Z0-9_-]+(#ephemeral)?, 1-64 characters", required=True)
_INTEGER = {"type": "integer", "format": "int64"}
_BOOL = {"type": "boolean"}


# the integer fields of ours in a topic's and a channel's stats (not in nsqd's), and what each counts
_OURS = {
    "topic": {
        "idempotency_keys": "Idempotency-Keys the topic holds",
        "log_first_position": "position (byte offset in the log's life) of the first record kept",
        "log_end_position": "position the next record is written at",
        "log_messages": "records the topic's log keeps",
        "log_bytes": "bytes of the topic's log on disk",
        "log_durable_position": "position up to which a sync round has fsynced the log (the durable tail)",
    },
    "channel": {
        "lag_messages": "messages not finished: queued, in flight, deferred",
        "oldest_unfinished_age_ms": "age of the oldest unfinished message (0: none)",
        "dead_lettered_count": "messages sent to the dead-letter topic",
        "expired_count": "messages past their TTL, not delivered",
        "refused_count": "publishes refused at the maximum depth",
        "dropped_count": "messages dropped for room (drop-oldest, ephemeral overflow)",
    },
}


def _integers(level: str) -> dict[str, dict]:
    return {key: {**_INTEGER, "description": text} for key, text in _OURS[level].items()}


_SETTINGS: dict[str, tuple[str, dict]] = {
    "mem_queue_size": ("messages kept in memory before the log", _INTEGER),
    "max_depth": ("most messages queued (0: no limit)", _INTEGER),
    "depth_policy": ("refuse (publishes past max_depth: E_PUB_FAILED, 503 TOPIC_FULL) or drop-oldest",
                     {"type": "string", "enum": ["refuse", "drop-oldest"]}),
    "message_ttl": ("a message older than this is not delivered (Go duration; 0s: never)", {"type": "string"}),
    "expired_to_dead_letter": ("an expired message goes to the dead-letter topic", _BOOL),
    "max_attempts": ("deliveries after which a requeued or timed-out message is dead-lettered (0: no limit)", _INTEGER),
    "dead_letter_topic": ("where dead letters go (default <topic>-<channel>-dlq)", {"type": "string"}),
}


def _settings_paths(paths: dict, op: Any, bad_query: str) -> None:
    """Not in nsqd: settings per topic and channel, and the re-drive of dead letters."""
    fields = {key: {**schema, "description": text} for key, (text, schema) in _SETTINGS.items()}
    answer = {"description": "What is set here, and what is obeyed", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"topic": {"type": "string"}, "channel": {"type": "string"},
                                         "config": {"type": "object", "properties": fields},
                                         "effective": {"type": "object", "properties": fields}}}}}}
    values = [_param(key, f"{text}; empty: unset", schema=schema) for key, (text, schema) in _SETTINGS.items()]
    bad = _err(*(f"INVALID_ARG_{key.upper()}" for key in _SETTINGS), "MISSING_ARG_DEAD_LETTER_TOPIC",
               "MISSING_ARG_TOPIC", "INVALID_ARG_TOPIC", bad_query)
    for kind, args in (("topic", [_TOPIC]), ("channel", [_TOPIC, _CHANNEL])):
        missing = _err("TOPIC_NOT_FOUND") if kind == "topic" else _err("TOPIC_NOT_FOUND", "CHANNEL_NOT_FOUND")
        paths[f"/{kind}/config"] = {
            "get": op(f"Not in nsqd: the {kind}'s settings", {"200": answer, "404": missing}, args),
            "post": op(f"Not in nsqd: set (or unset) the {kind}'s settings, persisted before the answer",
                       {"200": answer, "400": bad, "404": missing, "500": _err("INTERNAL_ERROR")}, args + values),
        }
    moved = {"description": "How many came back", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"topic": {"type": "string"}, "channel": {"type": "string"},
                                         "dead_letter_topic": {"type": "string"}, "moved": _INTEGER}}}}}
    limit = _param("limit", "most messages to move (default: all there are)", schema=_INTEGER)
    paths["/channel/redrive"] = {"post": op(
        "Not in nsqd: move the channel's dead letters back into it, attempts reset",
        {"200": moved, "400": _err("INVALID_ARG_LIMIT", "MISSING_ARG_TOPIC", "INVALID_ARG_TOPIC", bad_query),
         "404": _err("TOPIC_NOT_FOUND", "CHANNEL_NOT_FOUND"), "500": _err("INTERNAL_ERROR")},
        [_TOPIC, _CHANNEL, limit])}


def _schemas() -> dict:
    latency = {
        "type": "object",
        "properties": {
            "count": {"type": "integer"},
            "percentiles": {"type": "array", "nullable": True, "items": {
                "type": "object", "properties": {"quantile": {"type": "number"}, "value": {"type": "number",
                                                                                     "description": "nanoseconds"}}}},
        },
    }
    client = {"type": "object", "properties": {
        **{k: {"type": "string"} for k in ("client_id", "hostname", "version", "remote_address", "user_agent",
                                            "tls_cipher_suite", "tls_version", "tls_negotiated_protocol",
                                            "auth_identity", "auth_identity_url")},
        **{k: _INTEGER for k in ("state", "ready_count", "in_flight_count", "message_count", "finish_count",
                                  "requeue_count", "connect_ts", "sample_rate", "output_buffer_size",
                                  "output_buffer_timeout")},
        **{k: _BOOL for k in ("deflate", "snappy", "tls", "authed", "tls_negotiated_protocol_is_mutual")},
        "pub_counts": {"type": "array", "items": {"type": "object", "properties": {
            "topic": {"type": "string"}, "count": _INTEGER}}},
    }}
    channel = {"type": "object", "properties": {
        "channel_name": {"type": "string"},
        **{k: _INTEGER for k in ("depth", "backend_depth", "in_flight_count", "deferred_count", "message_count",
                                  "requeue_count", "timeout_count", "client_count")},
        "clients": {"type": "array", "nullable": True, "items": {"$ref": "#/components/schemas/Client"}},
        "paused": _BOOL,
        "e2e_processing_latency": {"$ref": "#/components/schemas/Latency"},
        **_integers("channel"),
        "delivery_to_fin_latency": {"allOf": [{"$ref": "#/components/schemas/Latency"}], "description":
                                    "delivery to FIN over the last 5-10 minutes: p50, p90, p99, p99.9 (nanoseconds)"},
        "cursor": {"type": "object", "description": "a positional reader's cursor (/log/commit); absent on "
                   "a consumer's channel", "properties": {
                       "last_commit": {**_INTEGER, "nullable": True,
                                       "description": "unix ms (null: not committed since the broker started)"},
                       "pins_retention": {**_BOOL, "description": "its position keeps the topic's log "
                                          "(false once idle past --cursor-idle-timeout, until its next commit)"}}},
    }}
    topic = {"type": "object", "properties": {
        "topic_name": {"type": "string"},
        "channels": {"type": "array", "items": {"$ref": "#/components/schemas/ChannelStats"}},
        **{k: _INTEGER for k in ("depth", "backend_depth", "message_count", "message_bytes")},
        "paused": _BOOL,
        "e2e_processing_latency": {"$ref": "#/components/schemas/Latency"},
        **_integers("topic"),
    }}
    memory = {"type": "object", "properties": {k: _INTEGER for k in (
        "heap_objects", "heap_idle_bytes", "heap_in_use_bytes", "heap_released_bytes", "gc_pause_usec_100",
        "gc_pause_usec_99", "gc_pause_usec_95", "next_gc_bytes", "gc_total_runs")}}
    stats = {"type": "object", "required": ["version", "health", "start_time", "topics", "producers"], "properties": {
        "version": {"type": "string"}, "health": {"type": "string"}, "start_time": _INTEGER,
        "topics": {"type": "array", "nullable": True, "items": {"$ref": "#/components/schemas/TopicStats"}},
        "memory": {"$ref": "#/components/schemas/Memory"},
        "producers": {"type": "array", "nullable": True, "items": {"$ref": "#/components/schemas/Client"}},
    }}
    info = {"type": "object", "properties": {
        "version": {"type": "string"}, "broadcast_address": {"type": "string"}, "hostname": {"type": "string"},
        "http_port": {"type": "integer"}, "tcp_port": {"type": "integer"}, "start_time": _INTEGER,
        "max_heartbeat_interval": {**_INTEGER, "description": "nanoseconds"},
        "max_output_buffer_size": _INTEGER,
        "max_output_buffer_timeout": {**_INTEGER, "description": "nanoseconds"},
        "max_deflate_level": {"type": "integer"},
        "topology_zone": {"type": "string", "description": "only with --topology-zone"},
        "topology_region": {"type": "string", "description": "only with --topology-region"},
        "idempotent_publish": {"type": "boolean"},
    }}
    unix_ns = {**_INTEGER, "description": "unix nanoseconds"}
    listed = {"type": "object", "properties": {
        "id": {"type": "string", "description": "the message's 16-character id"},
        "timestamp": {**_INTEGER, "description": "publish time, unix nanoseconds"},
        "attempts": {"type": "integer"},
        "body_size": {"type": "integer", "description": "bytes"},
        "body_preview": {"type": "string", "description": "the body's first 64 bytes as UTF-8 text, a byte that "
                                                          "is not UTF-8 written \\xNN"},
        "delivered_at": {**unix_ns, "description": "in_flight: when it was sent to its consumer (unix ns)"},
        "deadline": {**unix_ns, "description": "in_flight: when it times out; deferred: when it is due (unix ns)"},
        "client_id": {"type": "string", "description": "in_flight: its consumer's client_id, as /stats shows it"},
        "client_address": {"type": "string", "description": "in_flight: its consumer's remote address"},
        "age_ms": {**_INTEGER, "description": "queued: since it was published"},
    }}
    messages = {"type": "object", "properties": {
        "topic": {"type": "string"}, "channel": {"type": "string"},
        "state": {"type": "string", "enum": ["in_flight", "deferred", "queued"]},
        "count": _INTEGER,
        "messages": {"type": "array", "items": listed},
    }}
    error = {"type": "object", "required": ["message"], "properties": {"message": {"type": "string"}}}
    return {"Error": error, "Info": info, "Stats": stats, "TopicStats": topic, "ChannelStats": channel,
            "Client": client, "Latency": latency, "Memory": memory, "ChannelMessages": messages}


def openapi_spec() -> dict:
    """An OpenAPI 3.0 description of every endpoint: parameters, bodies, statuses and error messages."""
    not_allowed = _err("METHOD_NOT_ALLOWED")
    bad_query = "INVALID_REQUEST"

    def op(summary: str, responses: dict, parameters: list | None = None, body: dict | None = None,
           description: str = "") -> dict:
        operation: dict[str, Any] = {"summary": summary, "responses": {**responses, "405": not_allowed}}
        if description:
            operation["description"] = description
        if parameters:
            operation["parameters"] = parameters
        if body:
            operation["requestBody"] = body
        return operation

    binary_body = {"required": True, "content": {"application/octet-stream": {"schema": {
        "type": "string", "format": "binary"}}}}
    paths: dict[str, Any] = {
        "/ping": {"get": op("Health check", {
            "200": _TEXT_OK,
            "500": {"description": "unhealthy", "content": {"text/plain": {"schema": {
                "type": "string", "example": "NOK - failed to write to disk"}}}}})},
        "/info": {"get": op("Version and listening ports", {
            "200": {"description": "broker information", "content": {"application/json": {"schema": {
                "$ref": "#/components/schemas/Info"}}}}})},
        "/pub": {"post": op(
            "Publish one message", {
                "200": _TEXT_OK,
                "400": _err("MSG_EMPTY", "MISSING_ARG_TOPIC", "INVALID_TOPIC", "INVALID_DEFER", "INVALID_IDEMPOTENCY_KEY", bad_query),
                "413": _err("MSG_TOO_BIG"),
                "500": _err("INTERNAL_ERROR"),
                "503": _err("EXITING")},
            [_TOPIC, _param("defer", "delay delivery by this many milliseconds (0 to --max-defer-time, by default "
                            "--max-req-timeout)", schema=_INTEGER)],
            binary_body, "The body is the message (1 byte to --max-msg-size)."),
        },
        "/mpub": {"post": op(
            "Publish several messages", {
                "200": _TEXT_OK,
                "400": _err("MISSING_ARG_TOPIC", "INVALID_TOPIC", "INVALID_IDEMPOTENCY_KEY", bad_query),
                "413": _err("BODY_TOO_BIG", "MSG_TOO_BIG", "BAD_BODY", "BAD_MESSAGE"),
                "500": _err("INTERNAL_ERROR"),
                "503": _err("EXITING")},
            [_TOPIC, _param("binary", "false (default): one message per line, empty lines skipped; true: "
                                      "[count:int32][size:int32][bytes]... big-endian", schema={"type": "string"})],
            binary_body, "At most --max-body-size bytes in all."),
        },
        "/stats": {"get": op(
            "Topics, channels, clients and memory", {
                "200": {"description": "JSON with format=json, nsqd's text report otherwise", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Stats"}},
                    "text/plain": {"schema": {"type": "string"}}}},
                "400": _err(bad_query)},
            [_param("format", "json, or text (the default)", schema={"type": "string", "enum": ["json", "text"]}),
             _param("topic", "only this topic"), _param("channel", "only this channel"),
             _param("include_clients", "true (default) or false", schema={"type": "string"}),
             _param("include_mem", "true (default) or false", schema={"type": "string"})]),
        },
        "/metrics": {"get": {"summary": "The /stats figures in Prometheus text format", "responses": {
            "200": {"description": "text exposition format 0.0.4", "content": {"text/plain": {"schema": {
                "type": "string"}}}}, "405": not_allowed}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3 document", "content": {"application/json": {"schema": {
                "type": "object"}}}}, "405": not_allowed}}},
        "/config/{opt}": {
            "parameters": [{"name": "opt", "in": "path", "required": True, "description":
                            "an option's config-file name, e.g. nsqlookupd_tcp_addresses, log_level, mem_queue_size",
                            "schema": {"type": "string"}}],
            "get": op("Read an option (durations in nanoseconds)", {
                "200": {"description": "the value as JSON", "content": {"application/json": {"schema": {}}}},
                "400": _err("INVALID_OPTION")}),
            "put": op("Change nsqlookupd_tcp_addresses or log_level at run time", {
                "200": {"description": "the new value as JSON", "content": {"application/json": {"schema": {}}}},
                "400": _err("INVALID_OPTION", "INVALID_VALUE"),
                "413": _err("INVALID_VALUE")},
                body={"required": True, "content": {
                    "application/json": {"schema": {"type": "array", "items": {"type": "string"}},
                                         "example": ["127.0.0.1:4160"]},
                    "text/plain": {"schema": {"type": "string", "enum": list(GO_LOG_LEVELS)}}}}),
        },
    }
    topic_errors = {
        "create": ("Create a topic", {"400": _err("MISSING_ARG_TOPIC", "INVALID_TOPIC", bad_query)}),
        "delete": ("Delete a topic and its channels", {"400": _err("MISSING_ARG_TOPIC", bad_query),
                                                       "404": _err("TOPIC_NOT_FOUND")}),
        "empty": ("Drop every queued message of a topic", {"400": _err("MISSING_ARG_TOPIC", "INVALID_TOPIC", bad_query),
                                                           "404": _err("TOPIC_NOT_FOUND"),
                                                           "500": _err("INTERNAL_ERROR")}),
        "pause": ("Stop a topic's flow to its channels", {"400": _err("MISSING_ARG_TOPIC", bad_query),
                                                           "404": _err("TOPIC_NOT_FOUND")}),
        "unpause": ("Resume a paused topic", {"400": _err("MISSING_ARG_TOPIC", bad_query),
                                              "404": _err("TOPIC_NOT_FOUND")}),
    }
    for action, (summary, errors) in topic_errors.items():
        paths[f"/topic/{action}"] = {"post": op(summary, {"200": _EMPTY_OK, **errors}, [_TOPIC])}
    channel_args = _err("MISSING_ARG_TOPIC", "INVALID_ARG_TOPIC", "MISSING_ARG_CHANNEL", "INVALID_ARG_CHANNEL",
                        bad_query)
    channel_summaries = {
        "create": "Create a channel (the topic must exist)",
        "delete": "Delete a channel",
        "empty": "Drop every queued, in-flight and deferred message of a channel",
        "pause": "Stop delivering a channel's messages",
        "unpause": "Resume a paused channel",
    }
    for action, summary in channel_summaries.items():
        not_found = _err("TOPIC_NOT_FOUND") if action == "create" else _err("TOPIC_NOT_FOUND", "CHANNEL_NOT_FOUND")
        responses = {"200": _EMPTY_OK, "400": channel_args, "404": not_found}
        if action == "empty":
            responses["500"] = _err("INTERNAL_ERROR")
        paths[f"/channel/{action}"] = {"post": op(summary, responses, [_TOPIC, _CHANNEL])}
    seek_ok = {"description": "Where the channel now is", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"position": _INTEGER, "depth": _INTEGER}}}}}
    to = _param("to", "earliest, latest, unix milliseconds, or an RFC 3339 time", required=True)
    paths["/channel/seek"] = {"post": op(
        "Not in nsqd: deliver the topic's log again from a position (drops what the channel holds)",
        {"200": seek_ok, "400": _err("MISSING_ARG_TOPIC", "INVALID_ARG_TOPIC", "MISSING_ARG_CHANNEL",
                                     "INVALID_ARG_CHANNEL", "MISSING_ARG_TO", "INVALID_ARG_TO",
                                     "TOPIC_HAS_NO_LOG", "TIME_BEFORE_RETENTION", bad_query),
         "404": _err("TOPIC_NOT_FOUND", "CHANNEL_NOT_FOUND"), "500": _err("INTERNAL_ERROR")},
        [_TOPIC, _CHANNEL, to])}
    paths["/channel/messages"] = {"get": op(
        "Not in nsqd: a look at a channel's messages in one state (at most `limit`; what it costs is bounded "
        "by it, not by the channel's size)",
        {"200": {"description": "count: how many the channel has in that state (as /stats counts them); "
                                "messages: in flight and deferred nearest deadline first, queued in memory "
                                "then in the logs (deferred publishes not read from the log yet are counted, "
                                "not listed)",
                 "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChannelMessages"}}}},
         "400": _err("MISSING_ARG_TOPIC", "INVALID_ARG_TOPIC", "MISSING_ARG_CHANNEL", "INVALID_ARG_CHANNEL",
                     "MISSING_ARG_STATE", "INVALID_ARG_STATE", "INVALID_ARG_LIMIT", bad_query),
         "404": _err("TOPIC_NOT_FOUND", "CHANNEL_NOT_FOUND")},
        [_TOPIC, _CHANNEL,
         _param("state", "in_flight, deferred or queued", required=True,
                schema={"type": "string", "enum": ["in_flight", "deferred", "queued"]}),
         _param("limit", "at most this many messages", schema={"type": "integer", "minimum": 0, "maximum": 1000,
                                                               "default": 100})])}
    _settings_paths(paths, op, bad_query)
    _log_paths(paths, op, bad_query)
    _replica_paths(paths, op)
    return {
        "openapi": "3.0.3",
        "info": {"title": "trio-nsq nsqd HTTP API", "version": VERSION, "description":
                 "nsqd's HTTP API (same paths, parameters, statuses and messages), plus /metrics and this "
                 "document. Errors are JSON {\"message\": ...}; an unknown path is 404 NOT_FOUND and a wrong "
                 "method 405 METHOD_NOT_ALLOWED. With TLS required, plain HTTP answers 403 "
                 "{\"message\": \"TLS_REQUIRED\", \"https_port\": N}."},
        "paths": paths,
        "components": {"schemas": _schemas()},
    }


def _replica_paths(paths: dict, op: Any) -> None:
    """Not in nsqd: cluster mode's fetch, a follower's only request to a topic's leader
    (broker/http/replica_api.py; docs/cluster.md)."""
    integer = {"type": "integer", "minimum": 0}
    paths["/replica/fetch"] = {"get": op(
        "Not in nsqd, cluster mode only (--etcd-endpoints): a follower fetches the topic's log from its leader",
        {"200": {"description": "uint32 big-endian n, n bytes of JSON header {epoch, hwm, log_start, log_end, "
                                "log_id, positions, sizes, deadlines: [[position, unix deadline]], channels: "
                                "[[name, cursor position, paused]], paused, settings, channel_settings: {name: "
                                "settings}}, then the records as stored, concatenated (sizes[i] bytes each, at "
                                "positions[i])",
                 "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
         "400": _err("NOT_IN_CLUSTER_MODE", "MISSING_ARG_TOPIC", "INVALID_ARG_TOPIC", "MISSING_ARG_REPLICA",
                     "MISSING_ARG_EPOCH", "INVALID_ARG_EPOCH", "MISSING_ARG_POSITION", "INVALID_ARG_POSITION",
                     "MISSING_ARG_SYNCED", "INVALID_ARG_SYNCED", "INVALID_ARG_MAX_BYTES"),
         "404": _err("TOPIC_NOT_FOUND"),
         "409": _err("NOT_LEADER", "FENCED", "STALE_LEADER", "NOT_A_REPLICA"),
         "500": _err("INTERNAL_ERROR")},
        [_param("topic", "the replicated topic", required=True),
         _param("epoch", "the leader epoch the follower read from etcd (older: 409 FENCED; newer: 409 "
                "STALE_LEADER, the leader steps down)", required=True, schema=integer),
         _param("replica", "the follower's broker id (<broadcast address>:<HTTP port>)", required=True),
         _param("position", "the follower's log end: it holds everything below", required=True, schema=integer),
         _param("synced", "the follower's fsynced end (counts towards the high watermark)", required=True,
                schema=integer),
         _param("max_bytes", "bytes of records at most (default 1 MiB, at most 16 MiB; at least one record)",
                schema=integer)],
        description="Answers the records from `position` up to the leader's log end (not only the high "
                    "watermark); with nothing new it long-polls up to 0.5 s for an append or a high-watermark "
                    "change.")}


def _log_paths(paths: dict, op: Any, bad_query: str) -> None:
    """Not in nsqd: a topic's log read by position (broker/http/log_api.py; README "Reading a topic by
    position")."""
    topic = _param("topic", "the topic", required=True)
    log_id = _param("log_id", "the log id the caller expects (409 LOG_ID_MISMATCH when the log is another)")
    integer = {"type": "integer", "minimum": 0}

    def pos(name: str, description: str, required: bool = True) -> dict:
        return _param(name, description, required=required, schema=integer)

    def answer(description: str, *fields: str) -> dict:
        props = {"log_id": {"type": "string"}, **{f: _INTEGER for f in fields}}
        return {"description": description, "content": {"application/json": {"schema": {
            "type": "object", "properties": props}}}}

    common = ("MISSING_ARG_TOPIC", "INVALID_ARG_TOPIC", "TOPIC_HAS_NO_LOG", bad_query)
    position_errors = ("POSITION_PAST_END", "POSITION_NOT_A_RECORD")
    not_found = _err("TOPIC_NOT_FOUND", "POSITION_GONE")
    paths["/log/positions"] = {"get": op(
        "Not in nsqd: the log's first position, its durable end (nothing past it is served) and its id",
        {"200": answer("first/first_index: the first record kept; end/end_index: the durable tail",
                       "first", "first_index", "end", "end_index", "first_timestamp"),
         "400": _err(*common), "404": _err("TOPIC_NOT_FOUND")}, [topic])}
    paths["/log/position"] = {"get": op(
        "Not in nsqd: a position: the first record at or after `timestamp`, or the boundary after at most "
        "`records` records and `bytes` bytes from `from`",
        {"200": answer("a record boundary and its index", "position", "index"),
         "400": _err(*common, "INVALID_ARG_TIMESTAMP", "MISSING_ARG_FROM", "INVALID_ARG_FROM",
                     "INVALID_ARG_RECORDS", "INVALID_ARG_BYTES", *position_errors),
         "404": not_found, "409": _err("LOG_ID_MISMATCH")},
        [topic, _param("timestamp", "unix milliseconds", schema=integer), pos("from", "a position", False),
         pos("records", "at most this many records", False), pos("bytes", "at most this many bytes", False), log_id])}
    paths["/log/splits"] = {"get": op(
        "Not in nsqd: record boundaries cutting [start, end) into `parts` parts of similar size",
        {"200": {"description": "positions: sorted boundaries strictly inside the range",
                 "content": {"application/json": {"schema": {"type": "object", "properties": {
                     "log_id": {"type": "string"}, "positions": {"type": "array", "items": _INTEGER}}}}}},
         "400": _err(*common, "MISSING_ARG_START", "MISSING_ARG_END", "MISSING_ARG_PARTS", "INVALID_ARG_PARTS",
                     *position_errors),
         "404": not_found, "409": _err("LOG_ID_MISMATCH")},
        [topic, pos("start", "a record boundary"), pos("end", "a record boundary"),
         _param("parts", "how many parts (1-10000)", required=True, schema=integer), log_id])}
    paths["/log/read"] = {"get": op(
        "Not in nsqd: raw records from a position, within one segment, up to `end` and `max_bytes`",
        {"200": {"description": "the records as in go-diskqueue's files ([size int32 BE][timestamp ns int64 BE]"
                                "[attempts uint16 BE][id 16][body]), then each record's start offset (n+1 "
                                "little-endian int32), then (position, deadline ms) of deferred records as "
                                "little-endian int64 pairs. Headers X-NSQ-Log-Id, X-NSQ-Position, "
                                "X-NSQ-Next-Position, X-NSQ-First-Index, X-NSQ-Records, X-NSQ-Records-Bytes, "
                                "X-NSQ-Deadlines, X-NSQ-End",
                 "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
         "400": _err(*common, "MISSING_ARG_POSITION", "INVALID_ARG_POSITION", "INVALID_ARG_END",
                     "INVALID_ARG_MAX_BYTES", *position_errors),
         "404": not_found, "409": _err("LOG_ID_MISMATCH"), "500": _err("INTERNAL_ERROR")},
        [topic, pos("position", "a record boundary"), pos("end", "stop before this position", False),
         pos("max_bytes", "bytes of records at most (default 4 MiB, at most 64 MiB)", False), log_id])}
    paths["/log/commit"] = {"post": op(
        "Not in nsqd: a positional reader's durable cursor: the channel (made if need be, as a cursor: SUB "
        "to it is refused) finishes every record before `position` and none after it, on disk before the "
        "answer; it pins retention until idle past --cursor-idle-timeout. A channel with consumers, or one "
        "not made as a cursor, is refused (409)",
        {"200": answer("where the cursor is, and the channel's depth (the reader's lag)", "position", "depth"),
         "400": _err(*common, "MISSING_ARG_CHANNEL", "INVALID_ARG_CHANNEL", "INVALID_ARG_ADOPT",
                     "MISSING_ARG_POSITION", "INVALID_ARG_POSITION", *position_errors),
         "404": not_found, "409": _err("LOG_ID_MISMATCH", "CHANNEL_HAS_CONSUMERS", "CHANNEL_NOT_A_CURSOR"),
         "500": _err("INTERNAL_ERROR")},
        [topic, _CHANNEL, pos("position", "a record boundary"), log_id,
         _param("adopt", "true: make an existing channel without consumers a cursor (one an older trio-nsq "
                "made has no flag)", schema=_BOOL)])}
