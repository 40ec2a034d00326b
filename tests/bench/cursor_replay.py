"""A cursor file read back at start, beside the cursor before issue 41 (`python -m tests.bench.cursor_replay`).

A channel that leaves a record in flight for every few it finishes writes a gap per round: its cursor
file holds one block per round (the mark, and that round's FINs). Reading it back at start used to filter
every range kept so far at each block's mark, and pop a list's head for every range passed: 5k/10k/20k
gaps loaded in 2.3/8.7/38 s. Here each size is loaded by today's Cursor and by the one of commit
ad880d8 (its source read from git at run time), and then read through as a restart does (every range
skipped), so the growth shows beside the old one. Figures are printed and saved in bench-results.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

from trio_nsq.broker.storage.cursor import Cursor
from tests.bench.machine import describe, machine, merge_report

REPO = Path(__file__).resolve().parents[2]
OLD_COMMIT = "ad880d8"
EPOCH = 3


def gap_rounds(n: int) -> bytes:
    """A cursor file (trio-nsq-cursor 3, read by both) of n rounds, each leaving a gap: 4 records read, 3
    finished, the first left unfinished under the mark."""
    block = struct.Struct(">II")
    out = bytearray(b"trio-nsq-cursor 3\n")
    for i in range(n):
        body = struct.pack(">cqqQ", b"M", 0, 0, EPOCH) + struct.pack(">cI", b"R", 3)
        body += b"".join(struct.pack(">qqI", p, p, 1) for p in (40 * i + 10, 40 * i + 20, 40 * i + 30))
        out += block.pack(len(body), zlib.crc32(body)) + body
    return bytes(out)


def old_cursor() -> Any | None:
    """The Cursor class of OLD_COMMIT's broker/storage/cursor.py (None outside a git checkout)."""
    try:
        source = subprocess.run(["git", "show", f"{OLD_COMMIT}:broker/storage/cursor.py"], cwd=REPO,
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "old_cursor.py"
        path.write_bytes(source)
        spec = importlib.util.spec_from_file_location("old_cursor", path)
        assert spec is not None and spec.loader is not None
        module: ModuleType = importlib.util.module_from_spec(spec)
        sys.modules["old_cursor"] = module
        spec.loader.exec_module(module)
    return module.Cursor


def replay(cursor_class: Any, data: bytes, n: int) -> tuple[float, float]:
    """Seconds to load the file, and to read through it as a restart does (skip every record)."""
    started = time.perf_counter()
    cursor, sound = cursor_class.load(data, EPOCH)
    loaded = time.perf_counter() - started
    assert sound == len(data) and cursor.hidden() == 3 * n
    started = time.perf_counter()
    skip = cursor.skip
    for i in range(n):
        base = 40 * i
        skip(base)
        skip(base + 10)
        skip(base + 20)
        skip(base + 30)
    return loaded, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[5000, 10_000, 20_000, 50_000, 200_000])
    parser.add_argument("--old-up-to", type=int, default=20_000, help="largest count given to the old cursor")
    parser.add_argument("--output", default="bench-results.json")
    args = parser.parse_args()
    info = machine()
    print(describe(info), flush=True)
    old = old_cursor()
    rows: list[dict[str, Any]] = []
    for n in args.counts:
        data = gap_rounds(n)
        row: dict[str, Any] = {"gaps": n, "file_bytes": len(data)}
        row["load_s"], row["skip_s"] = replay(Cursor, data, n)
        if old is not None and n <= args.old_up_to:
            row["old_load_s"], row["old_skip_s"] = replay(old, data, n)
        rows.append(row)
        old_text = (f"   before: load {row['old_load_s']:.3f} s, read through {row['old_skip_s']:.3f} s"
                    if "old_load_s" in row else "")
        print(f"cursor file of {n:>7,} gaps ({len(data) / 1e6:6.1f} MB): load {row['load_s']:.3f} s, "
              f"read through {row['skip_s']:.3f} s{old_text}", flush=True)
    for a, b in zip(rows, rows[1:]):
        growth = (b["load_s"] + b["skip_s"]) / max(1e-9, a["load_s"] + a["skip_s"])
        print(f"  x{b['gaps'] / a['gaps']:.1f} gaps: x{growth:.2f} time")
    merge_report(args.output, {"machine": info, "rows": rows}, "cursor_replay")


if __name__ == "__main__":
    main()
