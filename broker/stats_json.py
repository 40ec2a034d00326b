"""/stats?format=json: a snapshot (broker/stats.py) as nsqd's JSON, byte for byte as Go nsqd writes it
(json.Marshal of its stats structs: keys in field order, Go's escaping). broker/http/endpoints.py calls
stats_json; nsqadmin, nsq_stat and nsq_to_* read what it writes.
"""

from __future__ import annotations

from typing import Any

from trio_nsq.broker.stats import ChannelStats, ClientStats, E2eLatency, NsqdStats, TopicStats
from trio_nsq.shared.http_api import go_json, go_number


def stats_json(stats: NsqdStats) -> bytes:
    """The whole /stats?format=json answer, keys in nsqd's order."""
    doc: dict[str, Any] = {
        "version": stats.version,
        "health": stats.health,
        "start_time": stats.start_time,
        "topics": None if stats.topics is None else [_topic(t) for t in stats.topics],
    }
    if stats.memory is not None:
        doc["memory"] = stats.memory.figures()
    doc["producers"] = None if stats.producers is None else [client_json(c) for c in stats.producers]
    return go_json(doc)


def _topic(t: TopicStats) -> dict[str, Any]:
    return {
        "topic_name": t.topic_name,
        "channels": [_channel(c) for c in t.channels],
        "depth": t.depth,
        "backend_depth": t.backend_depth,
        "message_count": t.message_count,
        "message_bytes": t.message_bytes,
        "paused": t.paused,
        "e2e_processing_latency": _latency(t.e2e_processing_latency),
        "idempotency_keys": t.idempotency_keys,
        "log_first_position": t.log_first_position,
        "log_end_position": t.log_end_position,
        "log_messages": t.log_messages,
        "log_bytes": t.log_bytes,
    }


def _channel(c: ChannelStats) -> dict[str, Any]:
    return {
        "channel_name": c.channel_name,
        "depth": c.depth,
        "backend_depth": c.backend_depth,
        "in_flight_count": c.in_flight_count,
        "deferred_count": c.deferred_count,
        "message_count": c.message_count,
        "requeue_count": c.requeue_count,
        "timeout_count": c.timeout_count,
        "client_count": c.client_count,
        "clients": None if c.clients is None else [client_json(x) for x in c.clients],
        "paused": c.paused,
        "e2e_processing_latency": _latency(c.e2e_processing_latency),
        "lag_messages": c.lag_messages,
        "oldest_unfinished_age_ms": c.oldest_unfinished_age_ms,
    }


def _latency(latency: E2eLatency) -> dict[str, Any]:
    percentiles = None
    if latency.percentiles is not None:
        percentiles = [{"quantile": go_number(p.quantile), "value": go_number(p.value)} for p in latency.percentiles]
    return {"count": latency.count, "percentiles": percentiles}


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
