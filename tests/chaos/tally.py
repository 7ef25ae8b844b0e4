"""The chaos suite's counts (issue 11): every chaos run records one outcome here, and
``tests/chaos/conftest.py`` prints the totals at the end of the session.

Outcomes (the only two allowed, plus the defects a run must never show):

- ``rolled_back``: the workload completed with exact evidence (afdwin: lost=0 duplicated=0
  torn=0) after a rollback or a ``release``;
- ``snapshot``: exit 0 was reported and a complete, restorable snapshot exists;
- ``false_success`` / ``hang`` / ``lost``: defects; a test that records one also fails.

``record(kind, outcome, lost_bytes=0)``: ``kind`` names the fault ("agent SIGKILL after:criu
dump", "ENOSPC write 7", ...); ``lost_bytes`` is the count of workload bytes that did not come
back (must be 0).
"""

from __future__ import annotations

import collections
import threading

OUTCOMES = ("rolled_back", "snapshot", "false_success", "hang", "lost")
DEFECTS = ("false_success", "hang", "lost")

_lock = threading.Lock()
_runs: list = []


def record(kind: str, outcome: str, lost_bytes: int = 0) -> None:
    """Count one chaos run; raises ValueError for an outcome not in :data:`OUTCOMES`."""
    if outcome not in OUTCOMES:
        raise ValueError(f"chaos run {kind!r}: unknown outcome {outcome!r} (one of {OUTCOMES})")
    with _lock:
        _runs.append((kind, outcome, int(lost_bytes)))


def summary() -> dict:
    """{"runs": N, "outcomes": {outcome: count}, "lost_bytes": total, "by_kind": {...}}."""
    with _lock:
        runs = list(_runs)
    by_kind = collections.defaultdict(collections.Counter)
    for kind, outcome, _ in runs:
        by_kind[kind.split(" ")[0]][outcome] += 1
    return {
        "runs": len(runs),
        "outcomes": dict(collections.Counter(o for _, o, _ in runs)),
        "lost_bytes": sum(b for _, _, b in runs),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
    }
