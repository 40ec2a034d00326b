"""The pytest11 plugin (trio_nsq/testing/pytest_plugin.py) as a user meets it: a test file of theirs, run by pytest."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parent.parent

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


@pytest.mark.slow
def test_fresh_venv_with_test_extra(tmp_path):
    """`pip install trio-nsq[test]` into a new venv; a pynsq user test using `nsqd` passes there."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # pure Python (TRIO_NSQ_COMPILE=0): what this test is about works in either build, and compiling
    # every hot module again took two of the suite's minutes (tests/test_packaging.py builds it compiled)
    subprocess.run([py, "-m", "pip", "install", "-q", f"{REPO_ROOT}[test]"], check=True,
                   env={**os.environ, "TRIO_NSQ_COMPILE": "0"})
    work = tmp_path / "user"
    work.mkdir()
    (work / "test_user.py").write_text(USER_TEST)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # (--basetemp: the user's run keeps its brokers' data dirs under ours, removed with it, not in /tmp)
    done = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'basetemp'}",
                           "test_user.py"], cwd=work, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
