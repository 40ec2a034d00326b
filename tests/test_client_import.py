"""Importing the client (in a web app, on a Spark worker) loads no server framework and no HTTP client.

Each import runs in a fresh interpreter, so what the test process already loaded cannot hide anything.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from processes import REPO_ROOT, repo_env

# nsqd's and nsqlookupd's HTTP stack, and httpx, which the client loads only when it needs it
# (lookupd discovery, HTTPProducer)
FORBIDDEN = ("quart", "quart_trio", "hypercorn", "werkzeug", "flask", "jinja2", "httpx", "httpcore", "h11")


def loaded_after(statement: str) -> list[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO_ROOT), env=repo_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("statement", [
    "import trio_nsq.client",
    "from trio_nsq import Producer, Consumer, HTTPProducer",
    # what a Spark worker imports: the format's hook, the reader's side and the client it runs
    "import pyspark_nsq, trio_nsq.spark.source, trio_nsq.client.consumer",
])
def test_client_imports_no_server_framework(statement):
    modules = loaded_after(statement)
    assert "trio_nsq.client" in modules or "pyspark_nsq" in modules
    servers = sorted({m.split(".")[0] for m in modules} & set(FORBIDDEN))
    assert servers == [], f"{statement!r} loaded {servers}"


def test_the_daemons_load_hypercorn_only_when_they_use_it():
    # shared/http.py serves plain HTTP with our own loop and re-exports the moved helpers; hypercorn
    # (a fifth of a daemon's start-up) comes with a TLS address or the first hand-off (tests/test_http_server.py)
    modules = loaded_after("from trio_nsq.shared.http import serve_site, split_host_port, join_host_port")
    assert "trio_nsq.shared.addresses" in modules and "trio_nsq.shared.http_server" in modules
    assert "hypercorn" not in {m.split(".")[0] for m in modules}
