"""carw's evidence: what each rank saw, and the launcher's verdict over all ranks. Pure.

A rank records every completed step (:meth:`StepLog.step`), every failed check (wrong sum,
wrong peer header, changed table) and its VAs; its ``done`` event is :meth:`StepLog.report`.
The launcher's summary (:func:`summarize`) is ``ok`` only when every rank completed steps
exactly 1..N once each with every sum exact, its table unchanged and its VAs identical
before and after every restore.
"""

from __future__ import annotations

MAX_FAILURES = 8  # failures kept verbatim per rank (all are counted)


class StepLog:
    """One rank's record. ``steps``: completed step numbers in completion order."""

    def __init__(self, rank: int):
        self.rank = rank
        self.steps: list[int] = []
        self.sums_exact = 0
        self.failures: list[str] = []
        self.failed = 0
        self.table_reads = 0
        self.table_changed = 0

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(what)

    def step(self, s: int, sum_exact: bool) -> None:
        self.steps.append(s)
        if sum_exact:
            self.sums_exact += 1

    def table(self, unchanged: bool, detail: str = "") -> None:
        self.table_reads += 1
        if not unchanged:
            self.table_changed += 1
            self.fail(f"pointer table changed: {detail}")

    def sequence(self) -> dict:
        """count, distinct, first, last, gaps, duplicates, in_order of the completed steps."""
        st = self.steps
        distinct = set(st)
        first, last = (min(st), max(st)) if st else (0, 0)
        return {
            "count": len(st),
            "distinct": len(distinct),
            "first": first,
            "last": last,
            "gaps": (last - first + 1 - len(distinct)) if st else 0,
            "duplicates": len(st) - len(distinct),
            "in_order": st == sorted(distinct),
        }

    def report(self) -> dict:
        return {
            "rank": self.rank,
            "sequence": self.sequence(),
            "sums_exact": self.sums_exact,
            "failed": self.failed,
            "failures": list(self.failures),
            "table_reads": self.table_reads,
            "table_changed": self.table_changed,
        }


def vas_key(ev: dict) -> tuple:
    """The VA facts of a ``vas`` event that must not change across a restore."""
    return (
        ev["pid"],
        ev["data_va"],
        ev["signal_va"],
        ev["table_va"],
        tuple(map(tuple, ev["table"])),
    )


def summarize(world: int, steps: int, done: list[dict], vas: list[dict]) -> dict:
    """The launcher's verdict. ``done``: the ranks' ``done`` reports; ``vas``: every ``vas``
    event (``after_restore`` False at start, True after each restored resume). Returns
    ``{"ok", "problems", "restores_seen", "va_tables_identical", ...}``."""
    problems = []
    want = {
        "count": steps,
        "distinct": steps,
        "first": 1,
        "last": steps,
        "gaps": 0,
        "duplicates": 0,
        "in_order": True,
    }
    by_rank = {d["rank"]: d for d in done}
    if sorted(by_rank) != list(range(world)):
        problems.append(f"done reports from ranks {sorted(by_rank)}, expected 0..{world - 1}")
    for r, d in sorted(by_rank.items()):
        for k, v in want.items():
            if d["sequence"].get(k) != v:
                problems.append(f"rank {r}: steps {k}={d['sequence'].get(k)}, expected {v}")
        if d["sums_exact"] != steps:
            problems.append(f"rank {r}: {d['sums_exact']} exact sums of {steps}")
        if d["failed"]:
            problems.append(f"rank {r}: {d['failed']} failed checks: {d['failures'][:3]}")
        if d["table_changed"]:
            problems.append(f"rank {r}: pointer table changed {d['table_changed']} times")
    first = {e["rank"]: vas_key(e) for e in vas if not e.get("after_restore")}
    if sorted(first) != list(range(world)):
        problems.append(f"start VAs from ranks {sorted(first)}, expected 0..{world - 1}")
    after = [e for e in vas if e.get("after_restore")]
    changed = [e["rank"] for e in after if first.get(e["rank"]) != vas_key(e)]
    if changed:
        problems.append(f"VAs or pointer table changed across a restore on ranks {changed}")
    restores = {}
    for e in after:
        restores[e["rank"]] = restores.get(e["rank"], 0) + 1
    seen = set(restores.values())
    if len(seen) > 1 or (after and len(restores) != world):
        problems.append(f"restored resumes per rank differ: {restores}")
    return {
        "ok": not problems,
        "problems": problems,
        "world": world,
        "steps": steps,
        "restores_seen": max(seen) if seen else 0,
        "va_tables_identical": not changed,
        "sums_exact": sum(d["sums_exact"] for d in done),
        "failed_checks": sum(d["failed"] for d in done),
    }
