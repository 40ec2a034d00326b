"""What a figure was measured on: the CPU, its cores, Python, and which trio-nsq modules ran compiled."""

from __future__ import annotations

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


def machine() -> dict[str, Any]:
    """Written to bench-results.json and printed: the figures mean nothing without it."""
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "compiled_modules": compiled.compiled_modules()}


def describe(info: dict[str, Any]) -> str:
    modules = info["compiled_modules"]
    shown = ", ".join(m.rsplit(".", 1)[-1] for m in modules) if modules else "none (pure Python)"
    return f"{info['cpu']}, {info['cpus']} cores, Python {info['python']}; compiled: {shown}"
