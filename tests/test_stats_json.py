"""/stats?format=json's renderer (broker/stats_json.py) without a broker: it writes topics and channels as
text, so each case is checked against the same document built as dicts in nsqd's key order and encoded
by go_json (json.Marshal's bytes), including the strings it has to escape."""

from __future__ import annotations

import pytest

from trio_nsq.broker.stats import (
    NO_FINS, ChannelStats, ClientStats, E2eLatency, MemStats, NsqdStats, Percentile, PubCount, TopicStats,
)
from trio_nsq.broker.stats_json import stats_json
from trio_nsq.shared.http_api import go_json

NO_E2E = {"count": 0, "percentiles": None}


def client(name: str, pub_counts: tuple[PubCount, ...] = (), authed: bool = False) -> ClientStats:
    return ClientStats(client_id=name, hostname=f"{name}<&>\u2028", remote_address="127.0.0.1:4001", state=3,
                       ready_count=1, in_flight_count=2, message_count=3, finish_count=4, requeue_count=5,
                       connect_ts=1700000000, sample_rate=0, deflate=True, snappy=False, user_agent='ua "é"',
                       tls=False, tls_cipher_suite="", tls_version="", tls_negotiated_protocol="",
                       output_buffer_size=16384, output_buffer_timeout=250, authed=authed,
                       auth_identity="who" if authed else "", auth_identity_url="", pub_counts=pub_counts)


def client_doc(c: ClientStats) -> dict:
    doc = {"client_id": c.client_id, "hostname": c.hostname, "version": "V2", "remote_address": c.remote_address,
           "state": 3, "ready_count": 1, "in_flight_count": 2, "message_count": 3, "finish_count": 4,
           "requeue_count": 5, "connect_ts": 1700000000, "sample_rate": 0, "deflate": True, "snappy": False,
           "user_agent": c.user_agent, "tls": False, "tls_cipher_suite": "", "tls_version": "",
           "tls_negotiated_protocol": "", "tls_negotiated_protocol_is_mutual": False, "output_buffer_size": 16384,
           "output_buffer_timeout": 250}
    if c.authed:
        doc.update(authed=True, auth_identity="who")
    if c.pub_counts:
        doc["pub_counts"] = [{"topic": p.topic, "count": p.count} for p in c.pub_counts]
    return doc


def channel(name: str, clients: tuple[ClientStats, ...] | None, e2e: E2eLatency = E2eLatency()) -> ChannelStats:
    return ChannelStats(name, 1, 2, 3, 4, 5, 6, 7, len(clients or ()), clients, True, e2e, 8, 9, E2eLatency(), 10, 11, 12, 13)


def channel_doc(c: ChannelStats, e2e: dict = NO_E2E) -> dict:
    return {"channel_name": c.channel_name, "depth": 1, "backend_depth": 2, "in_flight_count": 3, "deferred_count": 4,
            "message_count": 5, "requeue_count": 6, "timeout_count": 7, "client_count": c.client_count,
            "clients": None if c.clients is None else [client_doc(x) for x in c.clients], "paused": True,
            "e2e_processing_latency": e2e, "lag_messages": 8, "oldest_unfinished_age_ms": 9,
            "delivery_to_fin_latency": NO_E2E,
            "dead_lettered_count": c.dead_lettered_count, "expired_count": c.expired_count,
            "refused_count": c.refused_count, "dropped_count": c.dropped_count}


def topic(name: str, channels: tuple[ChannelStats, ...], e2e: E2eLatency = E2eLatency()) -> TopicStats:
    return TopicStats(name, channels, 10, 11, 12, 13, False, e2e, 14, 1 << 40, (2 << 40) + 5, 15, 16, (2 << 40) + 1)


def topic_doc(t: TopicStats, channels: list[dict], e2e: dict = NO_E2E) -> dict:
    return {"topic_name": t.topic_name, "channels": channels, "depth": 10, "backend_depth": 11, "message_count": 12,
            "message_bytes": 13, "paused": False, "e2e_processing_latency": e2e, "idempotency_keys": 14,
            "log_first_position": 1 << 40, "log_end_position": (2 << 40) + 5, "log_messages": 15, "log_bytes": 16,
            "log_durable_position": (2 << 40) + 1}


def test_topics_channels_clients_and_memory_in_nsqds_order():
    consumer, producer = client("c1"), client("p1", (PubCount("a", 2), PubCount("b#ephemeral", 1)), authed=True)
    ch = channel("ch#ephemeral", (consumer,))
    bare = channel("bare", None)
    t1, t2 = topic("a", (ch, bare)), topic("b-2.x_y#ephemeral", ())
    memory = MemStats(1, 0, 2, 0, 3, 4, 5, 0, 6)
    stats = NsqdStats("OK", 1700000000, (t1, t2), (producer,), memory)
    expected = {"version": "1.3.0", "health": "OK", "start_time": 1700000000,
                "topics": [topic_doc(t1, [channel_doc(ch), channel_doc(bare)]), topic_doc(t2, [])],
                "memory": {"heap_objects": 1, "heap_idle_bytes": 0, "heap_in_use_bytes": 2, "heap_released_bytes": 0,
                           "gc_pause_usec_100": 3, "gc_pause_usec_99": 4, "gc_pause_usec_95": 5, "next_gc_bytes": 0,
                           "gc_total_runs": 6},
                "producers": [client_doc(producer)]}
    assert stats_json(stats) == go_json(expected)


@pytest.mark.parametrize("topics, producers, expected_topics", [(None, None, None), ((), None, [])])
def test_no_topics_is_null_or_empty_and_memory_is_left_out(topics, producers, expected_topics):
    stats = NsqdStats("NOK - disk full <&>", 5, topics, producers, None)
    assert stats_json(stats) == go_json({"version": "1.3.0", "health": "NOK - disk full <&>", "start_time": 5,
                                         "topics": expected_topics, "producers": None})


def test_names_outside_nsqds_characters_are_escaped_as_go_does():
    """Names the HTTP and TCP APIs refuse cannot reach /stats from there, but if one did (a hand-edited
    nsqd.dat, an embedding application), it is still valid JSON with Go's escaping."""
    ch = channel('c"\\<\u2029\x01', None)
    t = topic("t<&>é", (ch,))
    stats = NsqdStats("OK", 1, (t,), None, None)
    expected = {"version": "1.3.0", "health": "OK", "start_time": 1,
                "topics": [topic_doc(t, [channel_doc(ch)])], "producers": None}
    assert stats_json(stats) == go_json(expected)
    assert b"\\u003c" in stats_json(stats) and b"\\u2029" in stats_json(stats)


def test_percentiles_are_written_as_go_writes_float64():
    e2e = E2eLatency(3, (Percentile(1.0, 59815304.0), Percentile(0.5, 1234.5)))
    ch = channel("ch", None, e2e)
    t = topic("t", (ch,), e2e)
    e2e_doc = {"count": 3, "percentiles": [{"quantile": 1, "value": 59815304}, {"quantile": 0.5, "value": 1234.5}]}
    stats = NsqdStats("OK", 1, (t,), None, None)
    assert stats_json(stats) == go_json({"version": "1.3.0", "health": "OK", "start_time": 1,
                                         "topics": [topic_doc(t, [channel_doc(ch, e2e_doc)], e2e_doc)],
                                         "producers": None})
    assert b'"percentiles":[{"quantile":1,"value":59815304},{"quantile":0.5,"value":1234.5}]' in stats_json(stats)


def test_delivery_to_fin_latency_follows_the_other_channel_keys():
    """trio-nsqd's channel keys come after nsqd's, in the order they were added; the delivery-to-FIN
    figures are written as the e2e ones (nanoseconds, as Go writes float64)."""
    fin = E2eLatency(12, (Percentile(0.5, 2000000.0), Percentile(0.9, 1500.5), Percentile(0.99, 9.0),
                          Percentile(0.999, 10.0)))
    ch = ChannelStats("ch", 1, 2, 3, 4, 5, 6, 7, 0, None, False, E2eLatency(), 8, 9, fin)
    text = stats_json(NsqdStats("OK", 1, (topic("t", (ch,)),), None, None))
    assert text.endswith(b'"lag_messages":8,"oldest_unfinished_age_ms":9,"delivery_to_fin_latency":{"count":12,'
                         b'"percentiles":[{"quantile":0.5,"value":2000000},{"quantile":0.9,"value":1500.5},'
                         b'{"quantile":0.99,"value":9},{"quantile":0.999,"value":10}]},"dead_lettered_count":0,"expired_count":0,'
                         b'"refused_count":0,"dropped_count":0}],"depth":10,'
                         b'"backend_depth":11,"message_count":12,"message_bytes":13,"paused":false,'
                         b'"e2e_processing_latency":{"count":0,"percentiles":null},"idempotency_keys":14,'
                         b'"log_first_position":1099511627776,"log_end_position":2199023255557,"log_messages":15,'
                         b'"log_bytes":16,"log_durable_position":2199023255553}],"producers":null}')


def test_a_channel_without_fins_has_zero_percentiles_written_once():
    idle = ChannelStats("idle", 1, 2, 3, 4, 5, 6, 7, 0, None, True, E2eLatency(), 8, 9, NO_FINS)
    zeros = {"count": 0, "percentiles": [{"quantile": q, "value": 0} for q in (0.5, 0.9, 0.99, 0.999)]}
    stats = NsqdStats("OK", 1, (topic("t", (idle,)),), None, None)
    doc = channel_doc(idle)
    doc["delivery_to_fin_latency"] = zeros
    assert stats_json(stats) == go_json({"version": "1.3.0", "health": "OK", "start_time": 1,
                                         "topics": [topic_doc(topic("t", (idle,)), [doc])], "producers": None})
