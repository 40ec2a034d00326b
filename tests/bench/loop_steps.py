"""trio-nsqd with every event-loop step timed: `python -m tests.bench.loop_steps <nsqd flags>`.

A trio Instrument times each task step, in wall time and in the loop thread's CPU time, and writes the
longest ones (JSON) to the file named by $TRIO_NSQ_LOOP_STEPS, at most once a second: how long the loop
stalls by its own work, apart from what the machine's other load adds to the wall time (a /ping polled
from outside sees both).
"""

from __future__ import annotations

import json
import os
import runpy
import time
from typing import Any

import trio

SLOW = 0.05  # steps at least this long (CPU) are counted


class StepTimes(trio.abc.Instrument):
    def __init__(self, path: str) -> None:
        self.path = path
        self.started = 0.0
        self.cpu = 0.0
        self.max_wall = 0.0
        self.max_cpu = 0.0
        self.slow = 0
        self.steps = 0
        self.top: list[tuple[float, float, str]] = []  # (cpu, wall, task) of the longest, longest first
        self.written = time.monotonic()

    def before_task_step(self, task: Any) -> None:
        self.started = time.perf_counter()
        self.cpu = time.thread_time()

    def after_task_step(self, task: Any) -> None:
        cpu = time.thread_time() - self.cpu
        wall = time.perf_counter() - self.started
        self.steps += 1
        self.max_wall = max(self.max_wall, wall)
        if cpu > self.max_cpu:
            self.max_cpu = cpu
        if cpu >= SLOW:
            self.slow += 1
            self.top = sorted([*self.top, (cpu, wall, task.name.split(" of ")[0])], reverse=True)[:5]
        now = time.monotonic()
        if now - self.written >= 1.0:
            self.written = now
            self.write()

    def write(self) -> None:
        doc = {"steps": self.steps, "max_cpu_ms": self.max_cpu * 1000, "max_wall_ms": self.max_wall * 1000,
               "cpu_over_50ms": self.slow, "top": [[c * 1000, w * 1000, name] for c, w, name in self.top]}
        with open(self.path + ".tmp", "w") as fh:
            json.dump(doc, fh)
        os.replace(self.path + ".tmp", self.path)


def main() -> None:
    path = os.environ["TRIO_NSQ_LOOP_STEPS"]
    run = trio.run

    def run_timed(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("instruments", []).append(StepTimes(path))
        return run(*args, **kwargs)

    trio.run = run_timed  # type: ignore[assignment]
    runpy.run_module("trio_nsq.broker", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
