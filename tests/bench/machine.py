"""What a figure was measured on: the CPU, its cores, Python, and which trio-nsq modules ran compiled;
process_stat, a process's CPU time so far; and merge_report, how each part of `make bench` adds its
figures to bench-results.json."""

from __future__ import annotations

import json
import os
import platform
from typing import Any

from trio_nsq import compiled


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def process_stat(pid: int) -> tuple[int, float]:
    """A process's parent pid and its user + system CPU-seconds so far (every thread), from /proc; OSError
    when it is gone."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine() -> dict[str, Any]:
    """Written to bench-results.json and printed: the figures mean nothing without it."""
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "compiled_modules": compiled.compiled_modules()}


def describe(info: dict[str, Any]) -> str:
    modules = info["compiled_modules"]
    shown = ", ".join(m.rsplit(".", 1)[-1] for m in modules) if modules else "none (pure Python)"
    return f"{info['cpu']}, {info['cpus']} cores, Python {info['python']}; compiled: {shown}"


def merge_report(path: str, value: Any, *keys: str) -> None:
    """Put `value` at report[keys[0]][keys[1]]... of the JSON file at `path`, keeping every other key:
    run.py writes the file, the Spark, versus and HTTP benches each add their part."""
    try:
        with open(path) as fh:
            report = json.load(fh)
    except (OSError, ValueError):
        report = {}
    node = report
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
