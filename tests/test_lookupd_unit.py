"""nsqlookupd without processes: IDENTIFY decoding, the protocol's effect on the RegistrationDB, the DB's
inactivity and tombstone filters, the HTTP pieces (Go's query parsing, httprouter's dispatch,
encoding/json's bytes, every handler), the options, and one NSQLookupd run in the test's nursery. The V1
wire (line splitting, the parser, framing) is tests/test_lookup_protocol.py's.

Expected texts and bytes are nsqlookupd's (nsqlookupd/*.go, internal/http_api, httprouter v1.3.0).
"""

from __future__ import annotations

import json
import struct
import time

import httpx
import pytest
import trio

from trio_nsq.lookupd.http_api import (
    ANSWERS_KEPT, GO_ZERO_TIME_UNIX_NANO, ROUTER, ROUTES, AnswerCache, channel_create, channel_delete, channels, debug, info, lookup, nodes,
    lookupd_site, ping, topic_create, topic_delete, topic_tombstone, topics,
)
from trio_nsq.lookupd.nsqlookupd import NSQLookupd
from trio_nsq.lookupd.options import Options, parse_options
from trio_nsq.lookupd.protocol_v1 import ClientV1, LookupProtocolV1, decode_identify
from trio_nsq.lookupd.registration_db import (
    PeerInfo, Producer, Registration, RegistrationDB, filter_active, filter_registrations, keys, subkeys,
)
from trio_nsq.shared.http_server import Request
from trio_nsq.shared.http_api import HTTPError, clean_path, go_json, go_query_unescape, parse_query
from trio_nsq.shared.lookup_protocol import error_data
from trio_nsq.shared.protocol import Command, FatalClientError
from trio_nsq.shared.version import VERSION

PEER = {"broadcast_address": "b1", "tcp_port": 4150, "http_port": 4151, "version": "1.3.0", "hostname": "h1"}


def identify_body(**overrides) -> bytes:
    return json.dumps({**PEER, **overrides}).encode()


def fatal(fn, *args) -> bytes:
    with pytest.raises(FatalClientError) as info_:
        fn(*args)
    return error_data(info_.value)


# --- IDENTIFY's JSON ---------------------------------------------------------------------------


def test_decode_identify_fields_and_real_remote_address():
    peer = decode_identify(identify_body(remote_address="spoofed:1", topology_zone="z", extra=[1]), "10.0.0.1:5")
    assert (peer.id, peer.remote_address, peer.broadcast_address, peer.hostname) == ("10.0.0.1:5", "10.0.0.1:5", "b1", "h1")
    assert (peer.tcp_port, peer.http_port, peer.version, peer.topology_zone) == (4150, 4151, "1.3.0", "z")
    assert peer.public()["topology_zone"] == "z" and "topology_region" not in peer.public()


def test_decode_identify_is_as_lenient_and_as_strict_as_encoding_json():
    # keys match case-insensitively, the last one wins; null leaves the zero value
    peer = decode_identify(b'{"Broadcast_Address":"x","broadcast_address":"b","TCP_PORT":1,"http_port":2,'
                           b'"version":"v","hostname":null}', "r:1")
    assert (peer.broadcast_address, peer.tcp_port, peer.hostname) == ("b", 1, "")
    # invalid UTF-8 in a string becomes U+FFFD
    peer = decode_identify(identify_body(hostname="HOST").replace(b"HOST", b"\xffH"), "r:1")
    assert peer.hostname == "\ufffdH"
    bad = [b"", b"{", b"[1]", b'"s"', b"1", identify_body(tcp_port="4150"), identify_body(tcp_port=4150.0),
           identify_body(tcp_port=True), identify_body(version=1), identify_body(hostname=["h"]),
           identify_body(tcp_port=2**63), b'{"tcp_port": NaN}']
    for body in bad:
        assert fatal(decode_identify, body, "r:1") == b"E_BAD_BODY IDENTIFY failed to decode JSON body", body
    for missing in ("broadcast_address", "tcp_port", "http_port", "version"):
        body = json.dumps({k: v for k, v in PEER.items() if k != missing}).encode()
        assert fatal(decode_identify, body, "r:1") == b"E_BAD_BODY IDENTIFY missing fields"
    assert fatal(decode_identify, b"null", "r:1") == b"E_BAD_BODY IDENTIFY missing fields"
    assert fatal(decode_identify, identify_body(tcp_port=0), "r:1") == b"E_BAD_BODY IDENTIFY missing fields"


# --- the protocol against a RegistrationDB -----------------------------------------------------


class FakeLookupd:
    def __init__(self, **options):
        self.db = RegistrationDB()
        self.options = Options(broadcast_address="lk.example", **options)
        self.tcp_address = ("127.0.0.1", 4160)
        self.http_address = ("127.0.0.1", 4161)


@pytest.fixture
def proto():
    return LookupProtocolV1(FakeLookupd())


def _identified(proto, remote="127.0.0.1:5000", **peer) -> ClientV1:
    client = ClientV1(remote)
    proto.exec(client, Command(b"IDENTIFY", (), identify_body(**peer)))
    return client


def test_identify_answers_with_this_lookupd_and_registers_the_client(proto):
    client = ClientV1("127.0.0.1:5000")
    answer = proto.exec(client, Command(b"IDENTIFY", (b"ignored",), identify_body()))
    decoded = json.loads(answer)
    assert list(decoded) == ["broadcast_address", "hostname", "http_port", "tcp_port", "version"]  # a Go map
    assert decoded["broadcast_address"] == "lk.example"
    assert (decoded["tcp_port"], decoded["http_port"], decoded["version"]) == (4160, 4161, VERSION)
    assert b" " not in answer  # compact, as json.Marshal
    assert [p.peer.id for p in proto.db.find_producers("client", "", "")] == ["127.0.0.1:5000"]
    assert fatal(proto.exec, client, Command(b"IDENTIFY", (), identify_body())) == b"E_INVALID cannot IDENTIFY again"


def test_register_and_unregister(proto):
    db = proto.db
    client = _identified(proto)
    assert proto.exec(client, Command(b"REGISTER", (b"t", b"c"))) == b"OK"
    assert proto.exec(client, Command(b"REGISTER", (b"t", b"c"))) == b"OK"  # twice is once
    assert proto.exec(client, Command(b"REGISTER", (b"t2",))) == b"OK"
    assert sorted(keys(db.find_registrations("topic", "*", ""))) == ["t", "t2"]
    assert subkeys(db.find_registrations("channel", "t", "*")) == ["c"]
    assert len(db.find_producers("channel", "t", "c")) == 1
    # a channel unregistered: its registration stays (Go leaves empty keys), its producer goes
    assert proto.exec(client, Command(b"UNREGISTER", (b"t", b"c"))) == b"OK"
    assert db.find_registrations("channel", "t", "c") and not db.find_producers("channel", "t", "c")
    # a topic unregistered takes the peer's channel registrations of it too
    proto.exec(client, Command(b"REGISTER", (b"t", b"c2")))
    proto.exec(client, Command(b"UNREGISTER", (b"t",)))
    assert not db.find_producers("channel", "t", "*") and not db.find_producers("topic", "t", "")
    assert db.find_registrations("topic", "t", "")  # listed until deleted over HTTP
    # unregistering what was never registered is fine
    assert proto.exec(client, Command(b"UNREGISTER", (b"never", b"was"))) == b"OK"


def test_ephemeral_registrations_go_with_their_last_producer(proto):
    db = proto.db
    a, b = _identified(proto, "127.0.0.1:1"), _identified(proto, "127.0.0.1:2")
    for client in (a, b):
        proto.exec(client, Command(b"REGISTER", (b"t#ephemeral", b"c#ephemeral")))
    proto.exec(a, Command(b"UNREGISTER", (b"t#ephemeral", b"c#ephemeral")))
    assert db.find_registrations("channel", "t#ephemeral", "c#ephemeral")  # b still has it
    proto.exec(b, Command(b"UNREGISTER", (b"t#ephemeral", b"c#ephemeral")))
    assert not db.find_registrations("channel", "t#ephemeral", "c#ephemeral")
    proto.exec(a, Command(b"UNREGISTER", (b"t#ephemeral",)))
    assert db.find_registrations("topic", "t#ephemeral", "")
    proto.exec(b, Command(b"UNREGISTER", (b"t#ephemeral",)))
    assert not db.find_registrations("topic", "t#ephemeral", "")


@pytest.mark.parametrize("command, text", [
    (Command(b"REGISTER", (b"bad*topic",)), b"E_BAD_TOPIC REGISTER topic name 'bad*topic' is not valid"),
    (Command(b"REGISTER", (b"",)), b"E_BAD_TOPIC REGISTER topic name '' is not valid"),
    (Command(b"REGISTER", (b"t" * 65,)), b"E_BAD_TOPIC REGISTER topic name '" + b"t" * 65 + b"' is not valid"),
    (Command(b"REGISTER", (b"t", b"bad*ch")), b"E_BAD_CHANNEL REGISTER channel name 'bad*ch' is not valid"),
    (Command(b"UNREGISTER", (b"\xff",)), b"E_BAD_TOPIC UNREGISTER topic name '\xff' is not valid"),
    (Command(b"REGISTER", ()), b"E_INVALID REGISTER insufficient number of params"),
    (Command(b"UNREGISTER", ()), b"E_INVALID UNREGISTER insufficient number of params"),
    (Command(b"WHAT", (b"x",)), b"E_INVALID invalid command WHAT"),
    (Command(b"", ()), b"E_INVALID invalid command "),
    (Command(b"ping", ()), b"E_INVALID invalid command ping"),  # commands are case-sensitive
])
def test_command_errors_are_gos(proto, command, text):
    client = _identified(proto)
    assert fatal(proto.exec, client, command) == text


def test_commands_before_identify(proto):
    client = ClientV1("127.0.0.1:5000")
    assert proto.exec(client, Command(b"PING", ())) == b"OK"  # allowed, refreshes nothing
    for name in (b"REGISTER", b"UNREGISTER"):
        assert fatal(proto.exec, client, Command(name, (b"t",))) == b"E_INVALID client must IDENTIFY"
    # IDENTIFY is checked before the name: an unidentified peer with a bad topic hears "must IDENTIFY"
    assert fatal(proto.exec, client, Command(b"REGISTER", (b"bad*",))) == b"E_INVALID client must IDENTIFY"


def test_ping_refreshes_every_registration_of_the_peer(proto):
    client = _identified(proto)
    proto.exec(client, Command(b"REGISTER", (b"t", b"c")))
    client.peer.last_update -= 1000
    producers = proto.db.find_producers("topic", "t", "")
    assert filter_active(producers, 300, 45) == []
    proto.exec(client, Command(b"PING", ()))
    assert len(filter_active(producers, 300, 45)) == 1
    assert len(filter_active(proto.db.find_producers("channel", "t", "c"), 300, 45)) == 1


def test_remove_peer_drops_all_its_registrations(proto):
    a, b = _identified(proto, "127.0.0.1:1"), _identified(proto, "127.0.0.1:2")
    for client in (a, b):
        proto.exec(client, Command(b"REGISTER", (b"t", b"c")))
    proto.remove_peer(a)
    assert proto.db.lookup_registrations("127.0.0.1:1") == []
    assert [p.peer.id for p in proto.db.find_producers("topic", "t", "")] == ["127.0.0.1:2"]
    assert [p.peer.id for p in proto.db.find_producers("client", "", "")] == ["127.0.0.1:2"]
    proto.remove_peer(ClientV1("never:identified"))  # nothing to do


# --- RegistrationDB ------------------------------------------------------------------------------


def test_registration_db_finds_like_go():
    db = RegistrationDB()
    p1, p2 = PeerInfo(id="a"), PeerInfo(id="b")
    for key, peer in [(Registration("topic", "t1", ""), p1), (Registration("topic", "t2", ""), p1),
                      (Registration("topic", "t2", ""), p2), (Registration("channel", "t2", "c"), p2)]:
        assert db.add_producer(key, Producer(peer)) is True
    assert db.add_producer(Registration("topic", "t1", ""), Producer(p1)) is False
    db.add_registration(Registration("topic", "empty", ""))
    assert sorted(keys(db.find_registrations("topic", "*", ""))) == ["empty", "t1", "t2"]
    assert db.find_registrations("topic", "t2", "") == [Registration("topic", "t2", "")]
    assert db.find_registrations("topic", "nope", "") == []
    assert db.find_registrations("channel", "*", "*") == [Registration("channel", "t2", "c")]
    # wildcards give each producer once
    assert sorted(p.peer.id for p in db.find_producers("topic", "*", "")) == ["a", "b"]
    assert db.find_producers("topic", "empty", "") == []
    assert sorted(db.lookup_registrations("b"), key=str) == sorted(
        [Registration("topic", "t2", ""), Registration("channel", "t2", "c")], key=str)
    assert filter_registrations(db.lookup_registrations("b"), "topic", "*", "") == [Registration("topic", "t2", "")]
    assert db.remove_producer(Registration("topic", "t2", ""), "a") == (True, 1)
    assert db.remove_producer(Registration("topic", "t2", ""), "a") == (False, 1)
    assert db.remove_producer(Registration("topic", "missing", ""), "a") == (False, 0)
    db.remove_registration(Registration("topic", "t2", ""))
    assert db.find_producers("topic", "t2", "") == []


def test_filter_active_inactivity_and_tombstones():
    fresh, stale = PeerInfo(id="fresh"), PeerInfo(id="stale")
    stale.last_update -= 301
    producers = [Producer(fresh), Producer(stale)]
    assert [p.peer.id for p in filter_active(producers, 300, 45)] == ["fresh"]
    assert [p.peer.id for p in filter_active(producers, 400, 45)] == ["fresh", "stale"]
    producers[0].tombstone()
    assert filter_active(producers[:1], 300, 45) == []
    assert len(filter_active(producers[:1], 300, 0)) == 1  # a lifetime of 0: tombstones ignored (/nodes)
    producers[0].tombstoned_at -= 46
    assert len(filter_active(producers[:1], 300, 45)) == 1  # the tombstone has expired
    assert producers[0].tombstoned  # the flag stays; only its age matters


def test_a_tombstone_is_per_topic():
    db = RegistrationDB()
    peer = PeerInfo(id="a", broadcast_address="b1", http_port=4151)
    for t in ("t1", "t2"):
        db.add_producer(Registration("topic", t, ""), Producer(peer))
    db.find_producers("topic", "t1", "")[0].tombstone()
    assert filter_active(db.find_producers("topic", "t1", ""), 300, 45) == []
    assert len(filter_active(db.find_producers("topic", "t2", ""), 300, 45)) == 1


# --- HTTP: Go's query parsing, routing and JSON ---------------------------------------------------


def test_parse_query_is_url_parsequery():
    assert parse_query(b"topic=a&topic=b&channel=c+d&x=%41%2b") == {"topic": ["a", "b"], "channel": ["c d"], "x": ["A+"]}
    assert parse_query(b"") == {}
    assert parse_query(b"&&topic&=v") == {"topic": [""], "": ["v"]}
    for bad in (b"topic=a;b", b"topic=%zz", b"topic=%4", b"t%=1", b"a=1&b=%&c=2"):
        with pytest.raises(ValueError):
            parse_query(bad)
    assert go_query_unescape("%e2%82%ac") == "€"


@pytest.mark.parametrize("path, cleaned", [
    ("/", "/"), ("/abc", "/abc"), ("/a/b/c/", "/a/b/c/"), ("", "/"), ("a/", "/a/"), ("abc/def", "/abc/def"),
    ("//", "/"), ("/abc//", "/abc/"), ("/abc//def//ghi", "/abc/def/ghi"), ("///abc", "/abc"), ("//abc//", "/abc/"),
    (".", "/"), ("./", "/"), ("/abc/./def", "/abc/def"), ("/./abc/def", "/abc/def"), ("/abc/.", "/abc/"),
    ("..", "/"), ("../", "/"), ("../../", "/"), ("../..", "/"), ("../../abc", "/abc"),
    ("/abc/def/ghi/../jkl", "/abc/def/jkl"), ("/abc/def/../ghi/../jkl", "/abc/jkl"), ("/abc/def/..", "/abc"),
    ("/abc/def/../..", "/"), ("/abc/def/../../..", "/"), ("/abc/def/../../../ghi/jkl/../../../mno", "/mno"),
    ("abc/./../def", "/def"), ("abc//./../def", "/def"), ("abc/../../././../def", "/def"),
])
def test_clean_path_is_httprouters(path, cleaned):
    # httprouter's own cleanTests (path_test.go), both ways
    assert clean_path(path) == cleaned
    assert clean_path(cleaned) == cleaned


@pytest.mark.parametrize("method, path, kind, extra", [
    ("GET", "/lookup", "handle", None),
    ("POST", "/topic/tombstone", "handle", None),
    ("GET", "/lookup/", "redirect", ("/lookup", 301)),
    ("POST", "/topic/create/", "redirect", ("/topic/create", 307)),
    ("GET", "/LOOKUP", "redirect", ("/lookup", 301)),
    ("GET", "//topics", "redirect", ("/topics", 301)),
    ("GET", "/x/../Nodes/", "redirect", ("/nodes", 301)),
    ("GET", "/topic/create", "not_allowed", "OPTIONS, POST"),
    ("POST", "/lookup", "not_allowed", "GET, OPTIONS"),
    ("HEAD", "/ping", "not_allowed", "GET, OPTIONS"),        # httprouter does not map HEAD to GET
    ("DELETE", "/topic/delete", "not_allowed", "OPTIONS, POST"),
    ("OPTIONS", "/ping", "options", "GET, OPTIONS"),
    ("OPTIONS", "/nope", "not_found", None),
    ("GET", "/", "not_found", None),
    ("GET", "/debug/pprof", "not_found", None),
    ("PUT", "/ping/", "not_found", None),                    # no PUT routes: no redirect, and no /ping/ anywhere
])
def test_resolve_is_httprouters_dispatch(method, path, kind, extra):
    where = ROUTER.resolve(method, path)
    assert where.kind == kind
    if kind == "redirect":
        assert (where.location, where.status) == extra
    elif kind in ("not_allowed", "options"):
        assert where.allow == extra


def test_every_route_has_one_method():
    assert ROUTER.allowed("/ping", "POST") == "GET, OPTIONS"
    assert ROUTER.allowed("/nope", "GET") == ""
    assert sorted(ROUTES["GET"]) == ["/channels", "/debug", "/info", "/lookup", "/nodes", "/ping", "/topics"]
    assert sorted(ROUTES["POST"]) == ["/channel/create", "/channel/delete", "/topic/create", "/topic/delete",
                                      "/topic/tombstone"]


def test_go_json_bytes():
    assert go_json({"a": [1, True, None], "b": "x"}) == b'{"a":[1,true,null],"b":"x"}'
    assert go_json({"h": "<a&b>\u2028é"}) == b'{"h":"\\u003ca\\u0026b\\u003e\\u2028\xc3\xa9"}'
    assert go_json({"message": "NOT_FOUND"}) == b'{"message":"NOT_FOUND"}'


# --- HTTP handlers -------------------------------------------------------------------------------


def http_error(fn, *args) -> tuple[int, str]:
    with pytest.raises(HTTPError) as err:
        fn(*args)
    return err.value.status, err.value.text


@pytest.fixture
def lk():
    fake = FakeLookupd(tombstone_lifetime=45.0)
    proto = LookupProtocolV1(fake)
    fake.client = _identified(proto)
    proto.exec(fake.client, Command(b"REGISTER", (b"t1", b"c1")))
    proto.exec(fake.client, Command(b"REGISTER", (b"t2",)))
    return fake


def test_simple_handlers(lk):
    assert ping(lk, b"") == "OK"
    assert info(lk, b"anything;at=all%") == {"version": VERSION}  # /info never parses the query
    assert sorted(topics(lk, b"")["topics"]) == ["t1", "t2"]
    assert channels(lk, b"topic=t1") == {"channels": ["c1"]}
    assert channels(lk, b"topic=nope") == {"channels": []}
    assert http_error(channels, lk, b"") == (400, "MISSING_ARG_TOPIC")
    assert http_error(channels, lk, b"topic=%") == (400, "INVALID_REQUEST")


def test_lookup_handler(lk):
    answer = lookup(lk, b"topic=t1")
    assert answer["channels"] == ["c1"]
    [producer] = answer["producers"]
    assert list(producer) == ["remote_address", "hostname", "broadcast_address", "tcp_port", "http_port",
                              "version"]  # PeerInfo's field order; topology fields only when the peer has them
    assert (producer["remote_address"], producer["broadcast_address"], producer["http_port"]) == (
        "127.0.0.1:5000", "b1", 4151)
    assert http_error(lookup, lk, b"topic=nope") == (404, "TOPIC_NOT_FOUND")
    assert http_error(lookup, lk, b"") == (400, "MISSING_ARG_TOPIC")
    assert http_error(lookup, lk, b"topic=a;b") == (400, "INVALID_REQUEST")
    assert http_error(lookup, lk, b"topic=") == (404, "TOPIC_NOT_FOUND")  # present but empty is present
    topic_create(lk, b"topic=x")  # a topic created over HTTP has no producers yet
    assert lookup(lk, b"topic=x") == {"channels": [], "producers": []}


def test_tombstone_handler_and_nodes(lk):
    assert http_error(topic_tombstone, lk, b"topic=t1") == (400, "MISSING_ARG_NODE")
    assert http_error(topic_tombstone, lk, b"node=b1:4151") == (400, "MISSING_ARG_TOPIC")
    assert topic_tombstone(lk, b"topic=t1&node=b1:9999") is None  # no such producer: still 200, as Go
    assert len(lookup(lk, b"topic=t1")["producers"]) == 1
    topic_tombstone(lk, b"topic=t1&node=b1:4151")
    assert lookup(lk, b"topic=t1")["producers"] == []
    assert len(lookup(lk, b"topic=t2")["producers"]) == 1
    [node] = nodes(lk, b"")["producers"]
    assert list(node)[-2:] == ["tombstones", "topics"]
    assert dict(zip(node["topics"], node["tombstones"])) == {"t1": True, "t2": False}
    # the tombstone's lifetime over, the producer is back
    lk.db.find_producers("topic", "t1", "")[0].tombstoned_at -= 46
    assert len(lookup(lk, b"topic=t1")["producers"]) == 1
    assert dict(zip(node["topics"], nodes(lk, b"")["producers"][0]["tombstones"])) == {"t1": False, "t2": False}


def _lookup_site_answer(site, query: bytes):
    async def no_body(cap):
        raise AssertionError("no body is read")

    reply = site.now(Request("GET", "/lookup", query, {"host": "lk"}, reader=no_body))
    return reply.status, (json.loads(reply.body) if reply.body else None)


def test_lookup_answers_are_kept_until_the_registrations_or_time_change_them(lk, monkeypatch):
    """/lookup's answer is kept by query string (AnswerCache): the same bytes for the next poll, and a
    fresh answer as soon as a registration, a tombstone, its lapse or a producer's silence changes it."""
    clock = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    answers = AnswerCache(lk)
    site = lookupd_site(lk, answers)
    status, first = _lookup_site_answer(site, b"topic=t1")
    assert status == 200 and first["channels"] == ["c1"] and len(first["producers"]) == 1
    [(generation, until, reply)] = answers.kept.values()
    assert generation == lk.db.generation and until == lk.client.peer.last_update + 300  # --inactive-producer-timeout
    assert answers.get(b"topic=t1") is reply
    assert site.now(Request("GET", "/lookup", b"topic=t1", {"host": "lk"}, reader=None)) is reply
    proto = LookupProtocolV1(lk)
    proto.exec(lk.client, Command(b"REGISTER", (b"t1", b"c2")))  # a new channel: a new generation
    assert _lookup_site_answer(site, b"topic=t1")[1]["channels"] == ["c1", "c2"]
    channel_delete(lk, b"topic=t1&channel=c2")
    assert _lookup_site_answer(site, b"topic=t1")[1]["channels"] == ["c1"]
    # a tombstone hides the producer at once, and its lapse (45 s, no DB change) shows it again
    topic_tombstone(lk, b"topic=t1&node=b1:4151")
    assert _lookup_site_answer(site, b"topic=t1")[1]["producers"] == []
    clock[0] += 44
    assert _lookup_site_answer(site, b"topic=t1")[1]["producers"] == []
    clock[0] += 2
    assert len(_lookup_site_answer(site, b"topic=t1")[1]["producers"]) == 1
    # a producer gone quiet drops out without any DB change; a PING brings it back, also without one
    clock[0] += 300 - 46 + 1
    assert _lookup_site_answer(site, b"topic=t1")[1]["producers"] == []
    assert b"topic=t1" not in answers.kept  # a quiet producer's PING changes no generation: not kept
    proto.exec(lk.client, Command(b"PING", ()))
    assert len(_lookup_site_answer(site, b"topic=t1")[1]["producers"]) == 1
    # removal is seen too; errors are never kept
    topic_delete(lk, b"topic=t1")
    assert _lookup_site_answer(site, b"topic=t1") == (404, {"message": "TOPIC_NOT_FOUND"})
    topic_create(lk, b"topic=t1")
    assert _lookup_site_answer(site, b"topic=t1") == (200, {"channels": [], "producers": []})


def test_the_kept_answers_are_bounded(lk):
    answers = AnswerCache(lk)
    site = lookupd_site(lk, answers)
    for i in range(ANSWERS_KEPT + 5):  # distinct query strings for the same topic
        assert _lookup_site_answer(site, b"topic=t2&n=%d" % i)[0] == 200
    assert 0 < len(answers.kept) <= ANSWERS_KEPT


def test_nodes_hides_inactive_producers(lk):
    assert len(nodes(lk, b"")["producers"]) == 1
    lk.client.peer.last_update -= 301
    assert nodes(lk, b"") == {"producers": []}
    assert lookup(lk, b"topic=t1")["producers"] == []
    assert topics(lk, b"")["topics"]  # the registrations stay


def test_topic_and_channel_admin_handlers(lk):
    assert http_error(topic_create, lk, b"") == (400, "MISSING_ARG_TOPIC")
    assert http_error(topic_create, lk, b"topic=bad*") == (400, "INVALID_ARG_TOPIC")
    topic_create(lk, b"topic=t3")
    assert "t3" in topics(lk, b"")["topics"]
    for query, error in [(b"", "MISSING_ARG_TOPIC"), (b"topic=b*", "INVALID_ARG_TOPIC"),
                         (b"topic=t3", "MISSING_ARG_CHANNEL"), (b"topic=t3&channel=b*", "INVALID_ARG_CHANNEL"),
                         (b"topic=t3&channel=c;", "INVALID_REQUEST")]:
        assert http_error(channel_create, lk, query) == (400, error)
        assert http_error(channel_delete, lk, query) == (400, error)
    channel_create(lk, b"topic=t4&channel=c4")  # creates the topic too
    assert "t4" in topics(lk, b"")["topics"] and channels(lk, b"topic=t4") == {"channels": ["c4"]}
    assert http_error(channel_delete, lk, b"topic=t4&channel=zz") == (404, "CHANNEL_NOT_FOUND")
    channel_delete(lk, b"topic=t4&channel=c4")
    assert channels(lk, b"topic=t4") == {"channels": []}
    # topic/delete takes the topic's channels, registered producers or not; no validation, no 404
    topic_delete(lk, b"topic=t1")
    assert "t1" not in topics(lk, b"")["topics"] and channels(lk, b"topic=t1") == {"channels": []}
    assert topic_delete(lk, b"topic=never*valid") is None
    assert http_error(topic_delete, lk, b"") == (400, "MISSING_ARG_TOPIC")


def test_debug_handler(lk):
    data = debug(lk, b"")
    assert list(data) == sorted(data) == ["channel:t1:c1", "client::", "topic:t1:", "topic:t2:"]
    entry = data["topic:t1:"][0]
    assert list(entry) == sorted(entry)  # a Go map
    assert entry["id"] == "127.0.0.1:5000" and entry["tombstoned"] is False
    assert entry["tombstoned_at"] == GO_ZERO_TIME_UNIX_NANO
    assert abs(entry["last_update"] - time.time_ns()) < 5e9
    topic_tombstone(lk, b"topic=t1&node=b1:4151")
    entry = debug(lk, b"")["topic:t1:"][0]
    assert entry["tombstoned"] is True and abs(entry["tombstoned_at"] - time.time_ns()) < 5e9


# --- options ---------------------------------------------------------------------------------------


def test_options_defaults_are_nsqlookupds():
    opts = parse_options([])
    assert (opts.tcp_address, opts.http_address) == ("0.0.0.0:4160", "0.0.0.0:4161")
    assert (opts.inactive_producer_timeout, opts.tombstone_lifetime) == (300.0, 45.0)
    assert (opts.log_level, opts.log_prefix) == ("info", "[nsqlookupd] ")
    assert opts.broadcast_address  # the hostname


@pytest.mark.parametrize("value, seconds", [("300s", 300.0), ("5m", 300.0), ("45s", 45.0), ("100ms", 0.1),
                                             ("1m30s", 90.0), ("2", 2.0), ("0.5", 0.5)])
def test_duration_flags(value, seconds):
    opts = parse_options([f"--inactive-producer-timeout={value}", "--tombstone-lifetime", value])
    assert opts.inactive_producer_timeout == opts.tombstone_lifetime == seconds


def test_config_file_and_flags_win(tmp_path):
    config = tmp_path / "nsqlookupd.cfg"
    config.write_text('tcp_address = "127.0.0.1:5160"\nhttp_address = "127.0.0.1:5161"\n'
                      'broadcast_address = "lk1"\ninactive_producer_timeout = "5m"\ntombstone_lifetime = "10s"\n'
                      'log_level = "debug"\n')
    opts = parse_options([f"--config={config}"])
    assert (opts.tcp_address, opts.http_address, opts.broadcast_address) == ("127.0.0.1:5160", "127.0.0.1:5161", "lk1")
    assert (opts.inactive_producer_timeout, opts.tombstone_lifetime, opts.log_level) == (300.0, 10.0, "debug")
    opts = parse_options([f"--config={config}", "--tcp-address=127.0.0.1:6160", "--tombstone-lifetime=1s"])
    assert (opts.tcp_address, opts.tombstone_lifetime, opts.http_address) == ("127.0.0.1:6160", 1.0, "127.0.0.1:5161")


@pytest.mark.parametrize("argv", [["--log-level=loud"], ["--tombstone-lifetime=soon"], ["--no-such-flag"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_options(argv)
    assert exit_.value.code == 2


# --- NSQLookupd in this test's nursery -------------------------------------------------------------


async def _v1_response(stream: trio.abc.Stream, buf: bytearray) -> bytes:
    while True:
        if len(buf) >= 4:
            (size,) = struct.unpack_from(">i", buf)
            if len(buf) >= 4 + size:
                data = bytes(buf[4 : 4 + size])
                del buf[: 4 + size]
                return data
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk


async def test_nsqlookupd_in_process_on_port_0():
    lookupd = NSQLookupd(Options(tcp_address="127.0.0.1:0", http_address="127.0.0.1:0", broadcast_address="lk"))
    async with trio.open_nursery() as nursery:
        await nursery.start(lookupd.run)
        (tcp_host, tcp_port), (http_host, http_port) = lookupd.tcp_address, lookupd.http_address
        assert tcp_host == http_host == "127.0.0.1" and tcp_port and http_port and tcp_port != http_port
        stream = await trio.open_tcp_stream(tcp_host, tcp_port)
        buf = bytearray()
        body = identify_body()
        await stream.send_all(b"  V1IDENTIFY\n" + struct.pack(">i", len(body)) + body + b"REGISTER t c\n")
        answer = json.loads(await _v1_response(stream, buf))
        assert (answer["tcp_port"], answer["http_port"], answer["broadcast_address"]) == (tcp_port, http_port, "lk")
        assert await _v1_response(stream, buf) == b"OK"
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
            r = await http.get("/lookup", params={"topic": "t"})
            assert r.status_code == 200 and r.headers["x-nsq-content-type"] == "nsq; version=1.0"
            assert r.json()["channels"] == ["c"] and r.json()["producers"][0]["tcp_port"] == 4150
            await stream.aclose()
            with trio.fail_after(5):
                while lookupd.db.find_producers("topic", "t", ""):
                    await trio.sleep(0.01)
            assert (await http.get("/nodes")).json() == {"producers": []}
        # cancelling run() ends every connection, and each peer's registrations go with it
        other = await trio.open_tcp_stream(tcp_host, tcp_port)
        await other.send_all(b"  V1IDENTIFY\n" + struct.pack(">i", len(body)) + body + b"REGISTER t2\n")
        buf = bytearray()
        await _v1_response(other, buf)
        assert await _v1_response(other, buf) == b"OK"
        nursery.cancel_scope.cancel()
    assert lookupd.db.find_producers("topic", "t2", "") == []
    assert lookupd.db.find_producers("client", "", "") == []
