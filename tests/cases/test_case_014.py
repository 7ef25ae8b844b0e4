"""Case 014 (shared/cases/014-timing-dependent-tests): tests that pass only on a quiet machine.

Kind: a test whose outcome depends on how fast the machine runs: a mid-stream cut that must
land inside a fixed step count (the workload had finished its 300 steps when a slow
checkpoint came: cut {(0, 2): 301, ...}), deadlines shorter than a loaded machine needs, sleeps
instead of events. The fix: afdwin ``--hold-at STEP[,STEP...]`` (docs/afdwin.md): an attention
rank does not issue step STEP + 1 before its k-th quiesce, while it still answers control, so
a checkpoint taken once every rank says ``hold`` cuts exactly at STEP, whatever the speed.

Here: afdwin 2A2F on fakecuda under the shim, held at step 40 of 300 (then at 80, which the
restored run's second quiesce would release: a SIGUSR1 releases it instead), checkpointed
with the real CRIU, killed, restored, finished. Asserted: the cut is exactly at the hold for
every pair (FFN ranks' last_seq at the cut == 40, attention ranks' issued == 40), the
manifest's parked ranks say the same, and the run ends with every pair's seqs exactly 1..300,
lost=0 duplicated=0 torn=0. No wall-clock limits: every wait is for an event, with a deadline
(minutes) that only catches a hang.
"""

from __future__ import annotations

import json
import signal

import pytest

from cuinterpose.workloads.afdwin import demo

STEPS, HOLD, HOLD2 = 300, 40, 80
RANKS, ATTENTION = 4, 2


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp


def test_mid_stream_cut_lands_exactly_at_the_hold(afdwin, tmp_path):
    a = afdwin(
        steps=STEPS, step_delay_ms=0, ranks=RANKS, attention=ATTENTION, hold_at=(HOLD, HOLD2)
    )
    assert a.wait_hold(1) == HOLD
    evs = a.events()
    assert sorted((e["rank"], e["step"], e["quiesce"]) for e in evs if demo.kind(e) == "hold") == [
        (r, HOLD, 1) for r in range(ATTENTION)
    ]
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(
        snap,
        "--quiesce-timeout-ms",
        str(int(demo.HANG_S * 1000)),
    )
    assert (rc, cp["ok"]) == (0, True), cp
    assert a.wait_dumped(demo.HANG_S) == -signal.SIGKILL
    evs = a.events()
    pairs = [(att, f) for att in range(ATTENTION) for f in range(ATTENTION, RANKS)]
    assert demo.cut_seqs(evs) == {p: HOLD for p in pairs}
    m = json.loads((snap / "manifest.json").read_text())
    parked = m["quiesce"]["ready"][str(a.pid)]["ranks"]
    assert sorted(
        (r["rank"], int(src), seq) for r in parked for src, seq in r["last_seq"].items()
    ) == sorted([(f, att, HOLD) for att, f in pairs] + [(att, f, HOLD) for att, f in pairs])

    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert (rc, rs["ok"]) == (0, True), rs
    # the restored run holds again at HOLD2 (its next quiesce would release it): a SIGUSR1
    # to each attention rank releases it without a checkpoint
    assert a.wait_hold(2) == HOLD2
    a.release_hold()
    assert a.wait_restored_exit(demo.HANG_S) in (0, None)
    evs = a.events()
    assert demo.check_run(evs, STEPS, attention=ATTENTION, ffn=RANKS - ATTENTION) == []
    done = [e for e in evs if demo.kind(e) == "done"]
    assert sorted(
        (p["src"], p["dst"], p["count"], p["first"], p["last"], p["lost"], p["duplicates"])
        for e in done
        for p in e["pairs"]
    ) == sorted(
        [(f, att, STEPS, 1, STEPS, 0, 0) for att, f in pairs]
        + [(att, f, STEPS, 1, STEPS, 0, 0) for att, f in pairs]
    )
    (s,) = [e for e in evs if demo.kind(e) == "summary"]
    n = len(pairs) * STEPS
    assert (s["ok"], s["messages"], s["replies"], s["lost"], s["duplicated"], s["torn"]) == (
        True,
        n,
        n,
        0,
        0,
        0,
    )
    assert (s["restores_seen"], s["quiesces"]) == (1, 1)
