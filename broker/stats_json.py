"""/stats?format=json: a snapshot (broker/stats.py) as nsqd's JSON, byte for byte as Go nsqd writes it
(json.Marshal of its stats structs: keys in field order, Go's escaping). broker/http/endpoints.py calls
stats_json; nsqadmin, nsq_stat and nsq_to_* read what it writes.

Topics and channels are written as text rather than built as dicts for json.dumps: with thousands of
topics the dicts and their encoding were most of /stats' time (issue 33). Strings still go through go_json
unless they hold only characters JSON never escapes; clients, producers, percentiles and memory (few,
and full of free text or floats) are built as dicts and encoded by go_json as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from trio_nsq.broker.stats import NO_FINS, ChannelStats, ClientStats, CursorStats, E2eLatency, NsqdStats, TopicStats
from trio_nsq.shared.http_api import go_json, go_number

# go_number returns 1 for 1.0; typed float, its answer would be made a float again where mypyc compiles
# this module (1.0, not Go's 1), so it is called as a function of unknown result
_go_number: Callable[[float], Any] = go_number

# what nsqd's names are made of (shared/names.py): written between quotes as they are
_PLAIN = re.compile(r"[.a-zA-Z0-9_#-]*")


def _string(text: str) -> str:
    return f'"{text}"' if _PLAIN.fullmatch(text) else go_json(text).decode()


def _bool(value: bool) -> str:
    return "true" if value else "false"


def stats_json(stats: NsqdStats) -> bytes:
    """The whole /stats?format=json answer, keys in nsqd's order."""
    topics = "null" if stats.topics is None else f"[{','.join(map(_topic, stats.topics))}]"
    memory = "" if stats.memory is None else f',"memory":{go_json(stats.memory.figures()).decode()}'
    producers = "null" if stats.producers is None else go_json([client_json(c) for c in stats.producers]).decode()
    text = (f'{{"version":{_string(stats.version)},"health":{_string(stats.health)},'
            f'"start_time":{stats.start_time},"topics":{topics}{memory},"producers":{producers}}}')
    return text.encode("utf-8", "replace")  # as go_json: a lone surrogate cannot be UTF-8


def _topic(t: TopicStats) -> str:
    return (f'{{"topic_name":{_string(t.topic_name)},"channels":[{",".join(map(_channel, t.channels))}],'
            f'"depth":{t.depth},"backend_depth":{t.backend_depth},"message_count":{t.message_count},'
            f'"message_bytes":{t.message_bytes},"paused":{_bool(t.paused)},'
            f'"e2e_processing_latency":{_latency(t.e2e_processing_latency)},"idempotency_keys":{t.idempotency_keys},'
            f'"log_first_position":{t.log_first_position},"log_end_position":{t.log_end_position},'
            f'"log_messages":{t.log_messages},"log_bytes":{t.log_bytes},"log_durable_position":{t.log_durable_position}'
            f'{_replication(t.replication)}}}')


def _replication(replication: dict[str, Any] | None) -> str:
    """Cluster mode only: the topic's `"replication"` key (nsqadmin shows it)."""
    return "" if replication is None else f',"replication":{json.dumps(replication, separators=(",", ":"))}'


def _channel(c: ChannelStats) -> str:
    if c.clients is None:
        clients = "null"
    elif not c.clients:  # most channels of a broker with thousands: no encoder made for an empty list
        clients = "[]"
    else:
        clients = go_json([client_json(client) for client in c.clients]).decode()
    return (f'{{"channel_name":{_string(c.channel_name)},"depth":{c.depth},"backend_depth":{c.backend_depth},'
            f'"in_flight_count":{c.in_flight_count},"deferred_count":{c.deferred_count},'
            f'"message_count":{c.message_count},"requeue_count":{c.requeue_count},'
            f'"timeout_count":{c.timeout_count},"client_count":{c.client_count},"clients":{clients},'
            f'"paused":{_bool(c.paused)},"e2e_processing_latency":{_latency(c.e2e_processing_latency)},'
            f'"lag_messages":{c.lag_messages},"oldest_unfinished_age_ms":{c.oldest_unfinished_age_ms},'
            f'"delivery_to_fin_latency":{_latency(c.delivery_to_fin_latency)},'
            f'"dead_lettered_count":{c.dead_lettered_count},"expired_count":{c.expired_count},'
            f'"refused_count":{c.refused_count},"dropped_count":{c.dropped_count}{_cursor(c.cursor)}}}')


def _cursor(cursor: CursorStats | None) -> str:
    """A positional reader's cursor's key; none on a consumer's channel (as Go's omitempty)."""
    if cursor is None:
        return ""
    last = "null" if cursor.last_commit is None else cursor.last_commit
    return f',"cursor":{{"last_commit":{last},"pins_retention":{_bool(cursor.pins_retention)}}}'


def _latency(latency: E2eLatency) -> str:
    if latency.percentiles is None:
        return f'{{"count":{latency.count},"percentiles":null}}'
    if latency is NO_FINS:  # every channel without FINs: written once
        return _NO_FINS_JSON
    percentiles = [{"quantile": _go_number(p.quantile), "value": _go_number(p.value)} for p in latency.percentiles]
    return go_json({"count": latency.count, "percentiles": percentiles}).decode()


def client_json(client: ClientStats) -> dict[str, Any]:
    """nsqd's ClientV2Stats as JSON, keys in its order (and its omitempty)."""
    out: dict[str, Any] = {
        "client_id": client.client_id,
        "hostname": client.hostname,
        "version": client.version,
        "remote_address": client.remote_address,
        "state": client.state,
        "ready_count": client.ready_count,
        "in_flight_count": client.in_flight_count,
        "message_count": client.message_count,
        "finish_count": client.finish_count,
        "requeue_count": client.requeue_count,
        "connect_ts": client.connect_ts,
        "sample_rate": client.sample_rate,
        "deflate": client.deflate,
        "snappy": client.snappy,
        "user_agent": client.user_agent,
        "tls": client.tls,
        "tls_cipher_suite": client.tls_cipher_suite,
        "tls_version": client.tls_version,
        "tls_negotiated_protocol": client.tls_negotiated_protocol,
        "tls_negotiated_protocol_is_mutual": False,
        "output_buffer_size": client.output_buffer_size,
        "output_buffer_timeout": client.output_buffer_timeout,
    }
    if client.authed:  # nsqd's omitempty
        out["authed"] = True
        if client.auth_identity:
            out["auth_identity"] = client.auth_identity
        if client.auth_identity_url:
            out["auth_identity_url"] = client.auth_identity_url
    if client.pub_counts:
        out["pub_counts"] = [{"topic": p.topic, "count": p.count} for p in client.pub_counts]
    return out


_NO_FINS_JSON = _latency(E2eLatency(NO_FINS.count, NO_FINS.percentiles))
