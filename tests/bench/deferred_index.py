"""A channel's deferred index at scale (broker/storage/deferred_index.py), before and after, in one run:

    python -m tests.bench.deferred_index [--counts 1000000 2000000 4000000] [--rounds N] [--no-cpu-calls]
                                         [--old-rev REV] [--no-old] [--output bench-results.json]

For each count, that many random deadlines (uniform over an hour, positions 0..count-1) are added one at
a time through add(), as LogReader.read does: the time for all the adds (the loop, with a clock read
around each call; wall and the thread's CPU time, which another process taking the core does not
lengthen), the longest single add() (what it stalls the event loop: in wall time, and in CPU time from a
second pass of the same adds, as the CPU clock is a system call), nbytes() per entry at the end and at
most on the way (every 4,096 adds past a quarter of them: merges in progress hold what they have
consumed of their inputs until it is cut off), and the runs it keeps. Then earliest(100) (GET
/channel/messages), entries_in and remove of 1,000 positions spread over them all (reclaim), and all are
made due and taken: due() until it moves none, the ready ones taken by 65,536 as Channel.take does (the
longest due() and take_ready() calls, due()'s in CPU time too). The growth is the CPU time of the adds
at a count over that at the first count, against the entries' (x4 entries should cost at most x4.5 the
time: O(n log n)).

The old implementation (the file at --old-rev, the commit before the rewrite, by default) is read with
`git show` into a temporary folder and loaded from there, measured the same way beside the new one (each
count of each in a process of its own, so none runs in a heap another has left):
compiled with mypyc there when this process runs the new one compiled (so both are), pure Python when it
does not (TRIO_NSQ_COMPILE=0). The figures go into bench-results.json under deferred_index.compiled or
deferred_index.pure.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from types import ModuleType
from typing import Any

from tests.bench.machine import describe, machine, merge_report
from trio_nsq import compiled
from trio_nsq.broker.storage import deferred_index

# the commit before DeferredIndex's rewrite (size-tiered runs merged a bounded step at a time)
OLD_REV = "ad880d86df2a1d10bb4d4b85085b0d5a32692d41"
PATH = "broker/storage/deferred_index.py"
HOUR = 3600.0
TAKE = 65_536  # what Channel.take asks of take_ready at most
LOOKED_UP = 1_000  # positions entries_in and remove are given

_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
sys.argv = ["setup.py", "build_ext", "--inplace", "-q"]
setup(name="old_deferred_index", ext_modules=mypycify(["old_deferred_index.py"], opt_level="3"))
"""


def _is_compiled(module: ModuleType) -> bool:
    return (getattr(module, "__file__", None) or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def old_module(rev: str, folder: str, compile_it: bool) -> str:
    """The DeferredIndex module as it was at `rev`, a file in `folder` (compiled there with mypyc when asked
    and possible): its path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    source = subprocess.run(["git", "show", f"{rev}:{PATH}"], cwd=root, check=True, capture_output=True).stdout
    path = os.path.join(folder, "old_deferred_index.py")
    with open(path, "wb") as fh:
        fh.write(source)
    if compile_it:
        built = subprocess.run([sys.executable, "-c", _SETUP], cwd=folder, capture_output=True, text=True)
        extensions = [name for name in os.listdir(folder) if name.startswith("old_deferred_index.")
                      and name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))]
        if built.returncode == 0 and extensions:
            path = os.path.join(folder, extensions[0])
        else:
            print(f"old implementation: mypyc failed, pure Python ({built.stderr.strip()[-300:]})", flush=True)
    return path


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_deferred_index", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _measure(old_path: str | None, count: int, seed: int, cpu_calls: bool) -> dict[str, float]:
    """In a process of its own (spawned): what one implementation, old (from its file) or new, does with
    `count` entries, in a heap nothing else has used."""
    cls = _load(old_path).DeferredIndex if old_path else deferred_index.DeferredIndex
    return run_once(cls, count, seed, cpu_calls)


def _deadlines(count: int, seed: int) -> array[float]:
    rng = random.Random(seed)
    return array("d", [rng.uniform(0.0, HOUR) for _ in range(count)])  # an array: nothing for the GC


def longest_add_cpu(cls: Any, count: int, seed: int) -> float:
    """The same adds again, each timed by the thread's CPU clock (a system call: not in the pass that
    times them all): the longest in ms."""
    deadlines = _deadlines(count, seed)
    idx = cls(lambda: 0.0)
    add = idx.add
    cpu = time.thread_time
    longest = 0.0
    for pos in range(count):
        c = cpu()
        add(deadlines[pos], pos)
        c = cpu() - c
        if c > longest:
            longest = c
    return longest * 1000


def run_once(cls: Any, count: int, seed: int, cpu_calls: bool) -> dict[str, float]:
    deadlines = _deadlines(count, seed)
    idx = cls(lambda: 0.0)
    add = idx.add
    clock = time.perf_counter
    cpu = time.thread_time
    longest_add = 0.0
    max_runs = 0
    peak_bytes = 0.0
    started = clock()
    started_cpu = cpu()
    for pos in range(count):
        t = clock()
        add(deadlines[pos], pos)
        t = clock() - t
        if t > longest_add:
            longest_add = t
        if not pos & 4095:
            max_runs = max(max_runs, len(idx._runs))
            if pos >= count // 4:
                peak_bytes = max(peak_bytes, idx.nbytes() / (pos + 1))
    add_cpu_s = cpu() - started_cpu
    add_s = clock() - started
    figures: dict[str, float] = {"add_s": add_s, "add_cpu_s": add_cpu_s, "longest_add_ms": longest_add * 1000,
                                 "bytes_per_entry": idx.nbytes() / count, "peak_bytes_per_entry": peak_bytes,
                                 "runs": len(idx._runs), "max_runs": max(max_runs, len(idx._runs))}
    t = clock()
    idx.earliest(100)
    figures["earliest_ms"] = (clock() - t) * 1000
    wanted = set(range(0, count, max(1, count // LOOKED_UP)))
    t = clock()
    found = idx.entries_in(wanted)
    figures["entries_in_ms"] = (clock() - t) * 1000
    t = clock()
    idx.remove(wanted)
    figures["remove_ms"] = (clock() - t) * 1000
    longest_due = longest_due_cpu = longest_take = 0.0
    calls = taken = 0
    started = clock()
    while True:
        t = clock()
        c = cpu()
        moved = idx.due(HOUR + 1.0)
        c = cpu() - c
        t = clock() - t
        longest_due = max(longest_due, t)
        longest_due_cpu = max(longest_due_cpu, c)
        calls += 1
        while True:
            t = clock()
            got = idx.take_ready(TAKE)
            t = clock() - t
            longest_take = max(longest_take, t)
            taken += len(got)
            if not got:
                break
        if not moved:
            break
    figures.update(drain_s=clock() - started, longest_due_ms=longest_due * 1000,
                   longest_due_cpu_ms=longest_due_cpu * 1000, due_calls=calls, longest_take_ms=longest_take * 1000)
    del idx, deadlines
    if cpu_calls:
        figures["longest_add_cpu_ms"] = longest_add_cpu(cls, count, seed)
    if taken != count - len(found) or len(found) != len(wanted):
        raise RuntimeError(f"{count:,} added, {len(found):,} of {len(wanted):,} found and removed, {taken:,} taken")
    return figures


def _line(name: str, count: int, f: dict[str, float], first: tuple[int, float]) -> str:
    entries_x, time_x = count / first[0], f["add_cpu_s"] / first[1]
    nan = float("nan")
    return (f"{name:<4} {count:>10,}: adds {f['add_s']:6.2f} s (CPU {f['add_cpu_s']:6.2f} s, "
            f"{f['add_cpu_s'] / count * 1e6:5.2f} us each), "
            f"longest add {f['longest_add_ms']:7.1f} ms (CPU {f.get('longest_add_cpu_ms', nan):6.1f}), longest due "
            f"{f['longest_due_ms']:7.1f} ms (CPU {f['longest_due_cpu_ms']:6.1f}; {f['due_calls']:,.0f} calls, all "
            f"due and taken in {f['drain_s']:5.2f} s), longest take "
            f"{f['longest_take_ms']:5.1f} ms, {f['bytes_per_entry']:5.2f} bytes/entry (at most "
            f"{f['peak_bytes_per_entry']:5.2f} on the way), {f['max_runs']:.0f} runs "
            f"at most; earliest(100) {f['earliest_ms']:5.2f} ms, entries_in({LOOKED_UP:,}) "
            f"{f['entries_in_ms']:6.0f} ms, remove({LOOKED_UP:,}) {f['remove_ms']:6.0f} ms; "
            f"x{entries_x:.1f} entries: x{time_x:.2f} CPU time")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="*", default=[1_000_000, 2_000_000, 4_000_000])
    parser.add_argument("--rounds", type=int, default=1,
                        help="each figure is the median of this many, but the longest calls the least of them "
                             "(the same calls each round: another process taking the core only lengthens them)")
    parser.add_argument("--no-cpu-calls", action="store_true",
                        help="no second pass of the adds timing each in CPU time (halves the bench's time)")
    parser.add_argument("--old-rev", default=OLD_REV, help="the commit whose DeferredIndex is the old one")
    parser.add_argument("--no-old", action="store_true", help="the new implementation alone")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", default="bench-results.json")
    args = parser.parse_args(argv)
    info = machine()
    print(f"machine: {describe(info)}")
    new_compiled = _is_compiled(deferred_index)
    impls: dict[str, str | None] = {"new": None}
    old_compiled = False
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="old-deferred-index-") as folder:
        if not args.no_old:
            impls["old"] = old_module(args.old_rev, folder, new_compiled)
            old_compiled = impls["old"].endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
        print(f"new: {'compiled' if new_compiled else 'pure Python'}"
              + ("" if args.no_old else f"; old ({args.old_rev}): {'compiled' if old_compiled else 'pure Python'}")
              + "; each count of each in a fresh process", flush=True)
        samples: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for count in args.counts:
                for name, path in impls.items():  # side by side, count by count
                    with spawn.Pool(1) as pool:
                        figures = pool.apply(_measure, (path, count, args.seed, not args.no_cpu_calls))
                    samples.setdefault(f"{name}|{count}", []).append(figures)
                    print(f"  {name} {count:,} done in {figures['add_s']:.2f} s", flush=True)
    results: dict[str, Any] = {"machine": info, "new_compiled": new_compiled, "old_compiled": old_compiled,
                               "old_rev": None if args.no_old else args.old_rev, "counts": {}}
    print()
    for name in impls:
        first: tuple[int, float] | None = None
        for count in args.counts:
            runs = samples[f"{name}|{count}"]
            med = {key: (min if key.startswith("longest_") else statistics.median)(run[key] for run in runs)
                   for key in runs[0]}
            if first is None:
                first = (count, med["add_cpu_s"])
            med["entries_x"] = count / first[0]
            med["time_x"] = med["add_cpu_s"] / first[1]
            results["counts"].setdefault(str(count), {})[name] = {**med, "rounds": runs}
            print(_line(name, count, med, first))
    merge_report(args.output, results, "deferred_index", "compiled" if new_compiled else "pure")
    return results


if __name__ == "__main__":
    main()
