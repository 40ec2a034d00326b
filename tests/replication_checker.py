"""The history checker of replication (issue 52): did a run lose, invent or fork anything?

Pure. tests/test_replication_model.py calls it at the end of every simulated history; the Jepsen-style
test of real brokers calls it after its heal and drain, with what its producers saw (`Op`), every body id
its consumers got, and each replica's log read back record by record.

- lost: an op answered "ok" whose id no consumer got (an OK means fsynced on >= min_isr replicas).
- unexpected: a delivered id no producer published, or one whose publish was answered "fail" (definitely
  not appended: refused before the append).
- divergent: a position below `high_watermark` whose record differs between replicas, or that one replica
  lacks (unless it lies below that replica's first record: retention removed it).
- duplicates: delivered copies beyond the first of an id: NSQ delivers at least once, so counted, not failed.
"info" ops (timeout, connection lost, refused after the append) may or may not be delivered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import attrs

RESULTS = ("ok", "fail", "info")


@attrs.frozen
class Op:
    """One publish, as the producer saw it."""

    id: str  # the message body's unique id
    invoked: float
    result: str  # "ok" | "fail" (definitely not appended) | "info" (unknown)

    def __attrs_post_init__(self) -> None:
        if self.result not in RESULTS:
            raise ValueError(f"an op's result is one of {RESULTS}, not {self.result!r}")


@attrs.frozen
class Report:
    lost: list[str]
    unexpected: list[str]
    divergent: list[str]
    duplicates: int
    ok: int
    fail: int
    info: int

    @property
    def valid(self) -> bool:
        return not self.lost and not self.unexpected and not self.divergent

    def summary(self, first: int = 5) -> str:
        """One line: the verdict, the counts, and the first few ids (positions) of each problem."""
        parts = [
            "valid" if self.valid else "INVALID",
            f"ok={self.ok} fail={self.fail} info={self.info} duplicates={self.duplicates}",
        ]
        for name, items in (("lost", self.lost), ("unexpected", self.unexpected), ("divergent", self.divergent)):
            shown = ", ".join(items[:first]) + (", ..." if len(items) > first else "")
            parts.append(f"{name}={len(items)}" + (f" [{shown}]" if items else ""))
        return " ".join(parts)


def check(
    ops: Sequence[Op],
    delivered: Sequence[str],
    replica_logs: Mapping[str, Sequence[tuple[int, bytes]]],
    high_watermark: int,
) -> Report:
    """Judge one history (see the module's docstring). `replica_logs`: replica name -> its records as
    (position, raw record), in position order, up to its end."""
    results = {op.id: op.result for op in ops}
    counts = Counter(delivered)
    lost = [op.id for op in ops if op.result == "ok" and op.id not in counts]
    unexpected = [item for item in counts if results.get(item, "fail") == "fail"]
    logs = {name: dict(records) for name, records in replica_logs.items()}
    # a replica's first record: below it retention removed records, which is not a divergence
    firsts = {name: min(records, default=0) for name, records in logs.items()}
    divergent: list[str] = []
    for position in sorted({p for records in logs.values() for p in records if p < high_watermark}):
        held = {name: records.get(position) for name, records in logs.items() if position >= firsts[name]}
        if len(set(held.values())) > 1:
            shown = ", ".join(f"{name}={'-' if record is None else repr(record[:24])}"
                              for name, record in sorted(held.items()))
            divergent.append(f"{position}: {shown}")
    by_result = Counter(op.result for op in ops)
    return Report(
        lost=lost,
        unexpected=unexpected,
        divergent=divergent,
        duplicates=sum(count - 1 for count in counts.values()),
        ok=by_result["ok"],
        fail=by_result["fail"],
        info=by_result["info"],
    )
