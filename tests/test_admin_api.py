"""trio-nsqadmin's JSON API against a real cluster: lookupd, two brokers registered with it, the admin.

The shapes are nsqadmin 1.3.0's (checked side by side with Go nsqadmin over Go nsqd): totals with
`node` "*" and the per-node rows beside them; every action is checked on the brokers' own /stats.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time

import httpx
import pytest

from nsq_raw import take
from processes import AdminProcess, BrokerProcess, LookupdProcess, free_port, wait_for
from trio_nsq.lookupd.admin.cluster import worst_latency


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("admin-cluster")
    lookupd = LookupdProcess(base, broadcast_address="127.0.0.1").start()
    brokers = [BrokerProcess(base, lookupd_tcp_address=lookupd.tcp_address, broadcast_address="127.0.0.1").start()
               for _ in range(2)]
    admin = AdminProcess(base, lookupd_http_address=lookupd.http_address).start()
    yield lookupd, brokers, admin
    for daemon in (admin, *brokers, lookupd):
        daemon.stop()


def publish(broker: BrokerProcess, topic: str, channel: str, n: int) -> None:
    assert broker.http.post(f"/topic/create?topic={topic}").status_code == 200
    assert broker.http.post(f"/channel/create?topic={topic}&channel={channel}").status_code == 200
    assert broker.http.post(f"/mpub?topic={topic}", content=b"\n".join(b"m%d" % i for i in range(n))).text == "OK"


def channel_on(broker: BrokerProcess, topic: str, channel: str) -> dict | None:
    topics = broker.http.get(f"/stats?format=json&topic={topic}").json()["topics"] or []
    return next((c for t in topics for c in t["channels"] if c["channel_name"] == channel), None)


def topic_on(broker: BrokerProcess, topic: str) -> dict | None:
    return next(iter(broker.http.get(f"/stats?format=json&topic={topic}").json()["topics"] or []), None)


def registered(lookupd: LookupdProcess, topic: str, n: int) -> None:
    wait_for(lambda: len(lookupd.get(f"/lookup?topic={topic}").json().get("producers", [])) == n, timeout=10,
             message=f"{topic} on {n} brokers in lookupd")


def test_topics_aggregate_over_the_nodes_with_a_row_per_node(cluster):
    lookupd, (b1, b2), admin = cluster
    publish(b1, "agg", "ch", 3)
    publish(b2, "agg", "ch", 5)
    registered(lookupd, "agg", 2)
    assert "agg" in admin.get("/api/topics").json()["topics"]
    wait_for(lambda: admin.get("/api/topics/agg/ch").json().get("depth") == 8, message="both channels filled")

    topic = admin.get("/api/topics/agg").json()
    assert (topic["node"], topic["topic_name"], topic["message_count"], topic["message"]) == ("*", "agg", 8, "")
    nodes = {row["node"]: row for row in topic["nodes"]}
    assert set(nodes) == {b1.http_address, b2.http_address}
    assert (nodes[b1.http_address]["message_count"], nodes[b2.http_address]["message_count"]) == (3, 5)
    assert [c["node"] for c in topic["channels"]] == ["*"] and topic["channels"][0]["depth"] == 8
    # nsqadmin's keys in nsqadmin's order, then trio-nsqd's log figures
    assert list(topic) == ["node", "hostname", "topic_name", "depth", "memory_depth", "backend_depth",
                           "message_count", "nodes", "channels", "paused", "e2e_processing_latency",
                           "log_messages", "log_bytes", "settings", "message"]
    assert topic["log_messages"] == 0  # at default flags the messages went through memory
    assert topic["channels"][0]["lag_messages"] == 8

    channel = admin.get("/api/topics/agg/ch").json()
    assert (channel["node"], channel["depth"], channel["message_count"], channel["client_count"]) == ("*", 8, 8, 0)
    assert sorted((r["node"], r["depth"]) for r in channel["nodes"]) == sorted(
        [(b1.http_address, 3), (b2.http_address, 5)])
    assert channel["e2e_processing_latency"] == {"count": 0, "percentiles": None, "topic": "agg", "channel": "ch",
                                                 "host": "*"}

    counter = admin.get("/api/counter").json()["stats"]
    assert counter[f"agg:ch:{b2.http_address}"] == {"node": b2.http_address, "topic_name": "agg",
                                                    "channel_name": "ch", "message_count": 5}


def test_delivery_to_fin_latency_per_node_and_in_total(cluster):
    """trio-nsqd's delivery-to-FIN figures in the channel rows: each node's as it reports them, the total
    with the FINs summed and each percentile the worst node's (here the only node with FINs)."""
    lookupd, (b1, b2), admin = cluster
    publish(b1, "fin", "ch", 3)
    publish(b2, "fin", "ch", 2)
    registered(lookupd, "fin", 2)
    take(b1.tcp_address, "fin", "ch", 3)
    wait_for(lambda: admin.get("/api/topics/fin/ch").json()["delivery_to_fin_latency"]["count"] == 3,
             message="the three FINs in the total")
    channel = admin.get("/api/topics/fin/ch").json()
    nodes = {row["node"]: row["delivery_to_fin_latency"] for row in channel["nodes"]}
    assert nodes[b2.http_address] == {"count": 0, "percentiles": [{"quantile": q, "value": 0}
                                                                   for q in (0.5, 0.9, 0.99, 0.999)]}
    assert nodes[b1.http_address]["count"] == 3 and all(p["value"] > 0 for p in nodes[b1.http_address]["percentiles"])
    assert channel["delivery_to_fin_latency"] == nodes[b1.http_address]
    [row] = admin.get("/api/topics/fin").json()["channels"]  # the topic page's channel row: the same total
    assert row["delivery_to_fin_latency"] == nodes[b1.http_address]


def test_worst_latency_sums_the_fins_and_takes_each_quantiles_worst():
    def latency(count, *values):
        return {"count": count, "percentiles": [{"quantile": q, "value": v} for q, v in zip((0.5, 0.99), values)]}
    assert worst_latency([latency(3, 10, 500), latency(5, 20, 90), latency(0, 0, 0)]) == latency(8, 20, 500)
    assert worst_latency([latency(0, 0, 0), {"count": 0, "percentiles": None}]) == {"count": 0, "percentiles": None}


def test_nodes_and_one_node(cluster):
    lookupd, (b1, b2), admin = cluster
    publish(b1, "nodes-t", "ch", 2)
    registered(lookupd, "nodes-t", 1)
    nodes = admin.get("/api/nodes").json()["nodes"]
    by_port = {n["http_port"]: n for n in nodes}
    assert {b1.http_port, b2.http_port} <= set(by_port)
    assert {"topic": "nodes-t", "tombstoned": False} in by_port[b1.http_port]["topics"]
    assert by_port[b1.http_port]["remote_addresses"][0].startswith(lookupd.http_address + "/")
    one = admin.get(f"/api/nodes/{b1.http_address}").json()
    assert one["node"] == b1.http_address and "nodes-t" in [t["topic_name"] for t in one["topics"]]
    assert one["total_messages"] >= 2
    assert admin.get("/api/nodes/127.0.0.1:1").status_code == 404


def test_channel_and_topic_actions_reach_every_broker(cluster):
    lookupd, (b1, b2), admin = cluster
    publish(b1, "act", "ch", 4)
    publish(b2, "act", "ch", 4)
    registered(lookupd, "act", 2)

    assert admin.http.post("/api/topics/act/ch", json={"action": "pause"}).json() == {"message": ""}
    assert channel_on(b1, "act", "ch")["paused"] and channel_on(b2, "act", "ch")["paused"]
    assert admin.get("/api/topics/act/ch").json()["paused"] is True
    admin.http.post("/api/topics/act/ch", json={"action": "unpause"})
    assert not channel_on(b1, "act", "ch")["paused"] and not channel_on(b2, "act", "ch")["paused"]

    admin.http.post("/api/topics/act/ch", json={"action": "empty"})
    assert channel_on(b1, "act", "ch")["depth"] == 0 and channel_on(b2, "act", "ch")["depth"] == 0

    admin.http.post("/api/topics/act", json={"action": "pause"})
    assert topic_on(b1, "act")["paused"] and topic_on(b2, "act")["paused"]
    admin.http.post("/api/topics/act", json={"action": "unpause"})
    assert not topic_on(b1, "act")["paused"]

    bad = admin.http.post("/api/topics/act", json={"action": "explode"})
    assert (bad.status_code, bad.json()) == (400, {"message": "INVALID_ACTION"})
    assert admin.http.post("/api/topics/act", content=b"not json").status_code == 400

    # trio-nsqd's seek, on every broker: the channel delivers again what the topic's log holds
    for broker in (b1, b2):
        assert broker.http.post("/pub?topic=act", content=b"x").text == "OK"
    wait_for(lambda: channel_on(b1, "act", "ch")["depth"] == 1 and channel_on(b2, "act", "ch")["depth"] == 1,
             message="one more message on each")
    assert admin.http.post("/api/topics/act/ch", json={"action": "seek", "to": "latest"}).json() == {"message": ""}
    assert channel_on(b1, "act", "ch")["depth"] == 0 and channel_on(b2, "act", "ch")["depth"] == 0
    bad = admin.http.post("/api/topics/act/ch", json={"action": "seek"})
    assert (bad.status_code, bad.json()) == (400, {"message": "INVALID_ARG_TO"})
    assert admin.http.post("/api/topics/act", json={"action": "seek", "to": "earliest"}).status_code == 400

    # trio-nsqd's settings, on every broker; a refusal in the broker's own words, nothing changed
    assert admin.http.post("/api/topics/act/ch", json={"action": "config", "settings": {
        "max_depth": 100, "depth_policy": "drop-oldest", "message_ttl": ""}}).json() == {"message": ""}
    for broker in (b1, b2):
        assert broker.http.get("/channel/config?topic=act&channel=ch").json()["config"] == {
            "max_depth": 100, "depth_policy": "drop-oldest"}
    settings = admin.get("/api/topics/act/ch").json()["settings"]
    assert settings["config"] == {"max_depth": 100, "depth_policy": "drop-oldest"}
    assert settings["effective"]["dead_letter_topic"] == "act-ch-dlq"
    refused = admin.http.post("/api/topics/act/ch", json={"action": "config", "settings": {"max_depth": "lots"}}).json()
    assert refused["message"].count("400 INVALID_ARG_MAX_DEPTH") == 2
    assert admin.http.post("/api/topics/act", json={"action": "config", "settings": {"max_attempts": 3}}).json() == {
        "message": ""}
    assert b2.http.get("/topic/config?topic=act").json()["config"] == {"max_attempts": 3}
    assert admin.get("/api/topics/act").json()["settings"]["config"] == {"max_attempts": 3}
    assert admin.http.post("/api/topics/act/ch", json={"action": "redrive"}).json() == {"moved": 0, "message": ""}
    bad = admin.http.post("/api/topics/act/ch", json={"action": "config", "settings": ["max_depth"]})
    assert (bad.status_code, bad.json()) == (400, {"message": "INVALID_ARG_SETTINGS"})

    assert admin.http.delete("/api/topics/act/ch").json() == {"message": ""}
    assert channel_on(b1, "act", "ch") is None and channel_on(b2, "act", "ch") is None
    admin.http.delete("/api/topics/act")
    assert topic_on(b1, "act") is None and topic_on(b2, "act") is None
    assert admin.get("/api/topics/act").status_code == 404


def test_a_channels_messages_from_every_broker(cluster):
    """/api/topics/:topic/:channel/messages: each broker's /channel/messages with its node beside each
    row, the counts summed; bad arguments refused as nsqd refuses them."""
    lookupd, (b1, b2), admin = cluster
    publish(b1, "look", "ch", 2)
    publish(b2, "look", "ch", 3)
    registered(lookupd, "look", 2)
    # the topics hand their messages to the channels after answering the MPUB
    wait_for(lambda: admin.get("/api/topics/look/ch").json().get("depth") == 5, message="both channels filled")
    queued = admin.get("/api/topics/look/ch/messages?state=queued&limit=10").json()
    assert (queued["state"], queued["count"], queued["message"]) == ("queued", 5, "")
    assert sorted((m["node"], m["body_preview"]) for m in queued["messages"]) == sorted(
        [(b1.http_address, "m0"), (b1.http_address, "m1"), (b2.http_address, "m0"), (b2.http_address, "m1"),
         (b2.http_address, "m2")])
    assert admin.get("/api/topics/look/ch/messages").json()["count"] == 0  # in flight: none
    assert admin.get("/api/topics/look/ch/messages?limit=1&state=queued").json()["count"] == 5
    assert len(admin.get("/api/topics/look/ch/messages?limit=1&state=queued").json()["messages"]) == 2  # one a node
    for query, message in (("state=gone", "INVALID_ARG_STATE"), ("limit=101", "INVALID_ARG_LIMIT"),
                           ("limit=x", "INVALID_ARG_LIMIT")):
        bad = admin.get(f"/api/topics/look/ch/messages?{query}")
        assert (bad.status_code, bad.json()) == (400, {"message": message})
    assert admin.get("/api/topics/look/nope/messages").status_code == 404


def test_create_and_tombstone(cluster):
    lookupd, (b1, b2), admin = cluster
    publish(b1, "made", "old", 1)
    registered(lookupd, "made", 1)
    assert admin.http.post("/api/topics", json={"topic": "made", "channel": "new"}).json() == {"message": ""}
    assert channel_on(b1, "made", "new") is not None  # created on the broker that has the topic
    assert "new" in lookupd.get("/channels?topic=made").json()["channels"]
    assert admin.http.post("/api/topics", json={"topic": "bad topic!"}).status_code == 400

    reply = admin.http.request("DELETE", f"/api/nodes/{b1.http_address}", json={"topic": "made"})
    assert reply.json() == {"message": ""}
    assert topic_on(b1, "made") is None
    producers = lookupd.get("/nodes").json()["producers"]
    mine = next(p for p in producers if p["http_port"] == b1.http_port)
    assert "made" not in mine["topics"] or mine["tombstones"][mine["topics"].index("made")]


def test_a_node_that_does_not_answer_is_reported_not_hidden(cluster, tmp_path):
    _, (b1, _b2), _ = cluster
    publish(b1, "partial", "ch", 2)
    dead = f"127.0.0.1:{free_port()}"
    admin = AdminProcess(tmp_path, f"--nsqd-http-address={b1.http_address}", f"--nsqd-http-address={dead}").start()
    try:
        topic = admin.get("/api/topics/partial").json()
        assert [r["node"] for r in topic["nodes"]] == [b1.http_address] and topic["message_count"] == 2
        assert topic["message"].startswith("WARNING: ") and dead in topic["message"]
        nodes = admin.get("/api/nodes").json()
        assert [n["http_port"] for n in nodes["nodes"]] == [b1.http_port] and dead in nodes["message"]
    finally:
        admin.stop()


def test_admin_users_and_notifications(cluster, tmp_path):
    lookupd, (b1, _b2), _ = cluster
    publish(b1, "acl", "ch", 1)
    registered(lookupd, "acl", 1)
    received: list[dict] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    admin = AdminProcess(tmp_path, lookupd_http_address=lookupd.http_address, admin_user="alice",
                         notification_http_endpoint=f"http://127.0.0.1:{hook.server_address[1]}/").start()
    try:
        refused = admin.http.post("/api/topics/acl/ch", json={"action": "pause"})
        assert (refused.status_code, refused.json()) == (403, {"message": "FORBIDDEN"})
        assert not channel_on(b1, "acl", "ch")["paused"]
        allowed = admin.http.post("/api/topics/acl/ch", json={"action": "pause"},
                                  headers={"X-Forwarded-User": "alice"})
        assert allowed.status_code == 200 and channel_on(b1, "acl", "ch")["paused"]
        wait_for(lambda: received, message="the notification")
        assert {k: received[0][k] for k in ("action", "topic", "channel", "user")} == {
            "action": "pause_channel", "topic": "acl", "channel": "ch", "user": "alice"}
        assert admin.get("/api/topics").status_code == 200  # reading needs no admin
    finally:
        admin.stop()
        hook.shutdown()


def test_ping_config_and_the_page(cluster):
    lookupd, _, admin = cluster
    assert admin.get("/ping").text == "OK"
    assert admin.get("/config/nsqlookupd_http_addresses").json() == [lookupd.http_address]
    assert admin.get("/config/nope").status_code == 400
    page = admin.get("/topics/anything")
    assert page.status_code == 200 and "trio-nsqadmin" in page.text and "window.NSQADMIN" in page.text
    assert admin.get("/static/app.js").headers["content-type"].startswith("application/javascript")
    assert admin.get("/static/../options.py").status_code == 404
    assert admin.http.post("/api/topics/x/y", content=b"{").status_code == 400
    with httpx.Client() as raw:  # an upload past the limit costs the request, not the admin
        assert raw.post(f"{admin.http_url}/api/topics", content=b"x" * (2 << 20)).status_code == 413
    assert admin.get("/ping").text == "OK"


def test_a_replicated_topics_replicas_leader_epoch_isr_and_high_watermark(tmp_path):
    """trio-nsqd in cluster mode (docs/cluster.md): the topic's page shows its replicas, which one leads, the
    epoch, the in-sync replicas and the high watermark, each replica as it reports itself (nsqlookupd lists only
    the leader: the followers are asked by their id). A follower killed shows as unreachable, then, once behind,
    out of sync."""
    from etcd_server import EtcdServer

    with EtcdServer(tmp_path) as etcd:
        lookupd = LookupdProcess(tmp_path, broadcast_address="127.0.0.1").start()
        flags = dict(lookupd_tcp_address=lookupd.tcp_address, broadcast_address="127.0.0.1",
                     etcd_endpoints=etcd.endpoint, etcd_lease_ttl="2s", replica_lag_time="2s", replicas=3, min_isr=2)
        brokers = [BrokerProcess(tmp_path, **flags).start() for _ in range(3)]
        admin = AdminProcess(tmp_path, lookupd_http_address=lookupd.http_address).start()
        try:
            b1 = brokers[0]
            ids = sorted(b.http_address for b in brokers)
            # the three alive in etcd (a broker listens before it has joined) before a topic is placed on them
            brokers_key = base64.b64encode(b"/trio-nsq/brokers/").decode()
            wait_for(lambda: int(httpx.post(f"{etcd.endpoint}/v3/kv/range", json={
                "key": brokers_key, "range_end": base64.b64encode(b"/trio-nsq/brokers0").decode(),
                "count_only": True}).json().get("count", 0)) == 3, timeout=15, message="three brokers in etcd")
            time.sleep(1.5)  # and in b1's view of them, which it re-reads from etcd at least every second
            assert b1.http.post("/topic/create?topic=rep").status_code == 200  # placed by b1, led by b1
            registered(lookupd, "rep", 1)
            wait_for(lambda: len(admin.get("/api/topics/rep").json().get("replication", {}).get("isr", [])) == 3,
                     timeout=15, message="three replicas in sync")
            assert b1.http.post("/mpub?topic=rep", content=b"a\nb\nc").text == "OK"
            end = topic_on(b1, "rep")["replication"]["log_end"]
            assert end > 0

            def page() -> dict:
                r = admin.get("/api/topics/rep").json()["replication"]
                return r if all(x["high_watermark"] == end for x in r["replicas"]) else {}

            rep = wait_for(page, timeout=10, message="the HWM at the log end on every replica")
            assert (rep["leader"], rep["epoch"], sorted(rep["isr"]), rep["min_isr"]) == (b1.http_address, 1, ids, 2)
            assert rep["high_watermark"] == rep["log_end"] == end
            rows = {x["id"]: x for x in rep["replicas"]}
            assert sorted(rows) == ids
            assert [x["id"] for x in rep["replicas"] if x["leader"]] == [b1.http_address]
            assert {x["id"]: x["role"] for x in rep["replicas"]} == {
                b.http_address: "leader" if b is b1 else "follower" for b in brokers}
            assert all(x["in_isr"] and x["reachable"] and x["epoch"] == 1 and x["log_end"] == end
                       for x in rep["replicas"])

            brokers[2].kill()  # a follower gone: unreachable at once, out of the isr once behind for --replica-lag-time
            gone = brokers[2].http_address
            # (a follower whose log is at the leader's end stays in sync, as in Kafka: something to fall behind on)
            assert b1.http.post("/pub?topic=rep", content=b"d", timeout=15).text == "OK"
            rep = wait_for(lambda: (r := admin.get("/api/topics/rep").json()["replication"])
                           and gone not in r["isr"] and r, timeout=15, message="the killed follower out of the isr")
            row = next(x for x in rep["replicas"] if x["id"] == gone)
            assert (row["reachable"], row["in_isr"]) == (False, False)
            assert admin.get("/api/topics/rep").json()["message"] == ""  # a replica down is shown, not an error
        finally:
            for daemon in (admin, *brokers, lookupd):
                daemon.stop()
