"""The hot modules run compiled by mypyc where this machine can build them, and `TRIO_NSQ_COMPILE=0`
runs the very same sources as pure Python (`.ci/run` runs the core's tests that way too)."""

from __future__ import annotations

import os
import subprocess
import sys

from trio_nsq import compiled


def test_the_build_is_compiled_wherever_it_can_be():
    reason = compiled.why_not_compiled()
    if reason is None:
        assert compiled.compiled_modules() == list(compiled.MODULES)
    else:
        # pure Python, as this machine's build was (or TRIO_NSQ_COMPILE=0 turns it off at run time)
        assert compiled.compiled_modules() == [], reason


def test_the_switch_runs_the_sources_even_where_compiled_modules_are_installed():
    script = ("import trio_nsq.broker.nsqd, trio_nsq.compiled as c, sys\n"
              "print(c.compiled_modules(), all(sys.modules[m].__file__.endswith('.py') for m in c.MODULES))")
    env = {**os.environ, compiled.ENV: "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "True"]
