"""The pytest11 plugin (trio_nsq/testing/pytest_plugin.py) as a user meets it: a test file of theirs, run by pytest.
The same file run in a venv the built wheel was installed into: tests/test_packaging.py."""

import pytest

pytest_plugins = ["pytester"]

USER_TEST = '''
import time
import nsq.sync  # pynsq's blocking connection
import pytest

def _consume_one(address, topic):
    host, port = address.rsplit(":", 1)
    conn = nsq.sync.SyncConn(timeout=5)
    conn.connect(host, int(port))
    conn.send(nsq.protocol.identify({"feature_negotiation": False}))
    conn.send(nsq.protocol.subscribe(topic, "ch"))
    conn.send(nsq.protocol.ready(1))
    while True:
        frame_type, data = nsq.protocol.unpack_response(conn.read_response())
        if frame_type == nsq.protocol.FRAME_TYPE_MESSAGE:
            msg = nsq.protocol.decode_message(data)
            conn.send(nsq.protocol.finish(msg.id))
            return msg.body

def test_publish_and_consume(nsqd):
    host, port = nsqd.tcp_address.rsplit(":", 1)
    conn = nsq.sync.SyncConn(timeout=5)
    conn.connect(host, int(port))
    conn.send(nsq.protocol.pub("orders", b"first"))
    assert nsq.protocol.unpack_response(conn.read_response())[1] == b"OK"
    nsqd.publish("orders", b"second")
    assert nsqd.depth("orders") == 2
    assert _consume_one(nsqd.tcp_address, "orders") == b"first"

def test_lookupd(nsqlookupd):
    import httpx
    assert httpx.get(f"http://{nsqlookupd.http_address}/ping").text == "OK"
'''


@pytest.mark.parametrize("mode", ["subprocess", "inprocess"])
def test_user_file_with_pynsq(pytester, mode):
    """A user's test file that names `nsqd`/`nsqlookupd` passes with nothing but the installed plugin."""
    pytester.makepyfile(test_user=USER_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--nsq-mode={mode}", "-o", "trio_mode=false")
    result.assert_outcomes(passed=2)


def test_plugin_idle_without_fixtures(pytester):
    """A test that asks for no fixture of ours starts nothing (no broker log under the basetemp)."""
    pytester.makepyfile(test_other="def test_x(tmp_path_factory):\n    assert not list(tmp_path_factory.getbasetemp().glob('nsqd*'))\n")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
