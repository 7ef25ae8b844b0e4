"""Helpers shared by the group end-to-end tests (afdwin jobs on fakecuda, one agent each)."""

from __future__ import annotations

import os
import time

from metrics_kit import scrape

from cuinterpose.workloads.afdwin import demo

STEPS = 300


HOLD = 20


def start_jobs(afdwin, steps=STEPS):
    """Two afdwin jobs (5 ms a step), each held at step HOLD until its first quiesce (or
    :func:`release`), so a group checkpoint finds them mid-stream however slow it is."""
    return [afdwin(steps=steps, step_delay_ms=5, hold_at=(HOLD,)) for _ in range(2)]


def wait_running(jobs):
    for j in jobs:
        j.wait_hold()


def release(jobs):
    """End the hold of jobs that may never have seen a quiesce (a group refused before it):
    after a quiesce it changes nothing (one hold only)."""
    for j in jobs:
        j.release_hold()


def agents(daemon, jobs, *extra, listen=""):
    """One daemon per job: node-a, node-b, on fakecuda with that job's control dir."""
    return [
        daemon(f"node-{n}", "--driver", "fake", "--control-dir", str(j.ctl), *extra, listen=listen)
        for n, j in zip("ab", jobs)
    ]


def reap_tree(m):
    """Reap every process of a killed tree (its ranks are re-parented to this subreaper and
    may die after the root): CRIU restores the same pids, so they must be free."""
    deadline = time.monotonic() + demo.HANG_S
    pids = [p["pid"] for p in m["processes"]]
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        assert time.monotonic() < deadline, pids
        demo.reap_zombies()
        time.sleep(0.01)


def idx(rows, event, pred):
    return [i for i, r in enumerate(rows) if r["event"] == event and pred(r)]


def metrics(info) -> dict:
    """{sample with labels: value} of a daemon's /metrics (``cuinterpose_*``, no _created)."""
    return scrape(info["metrics_port"])


def finished_intact(jobs, steps, *, restored=False):
    """Wait for each job to end; assert every message arrived exactly once (lost=0,
    duplicated=0, torn=0) and that it was resumed exactly once: restored, or rolled back."""
    release(jobs)
    for j in jobs:
        if restored:
            assert j.wait_restored_exit(300) in (0, None)
        else:
            j.wait_ok(300)  # never killed: ran to the end
        evs = j.events()
        assert demo.check_run(evs, steps, expect_restore=restored) == []
        assert [(e["restored"], e["cancelled"]) for e in evs if demo.kind(e) == "resumed"] == [
            (restored, False)
        ]
