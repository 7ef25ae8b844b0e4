"""Issue 23: a same-uid process outside the job cannot tear it down (protocol.h "Claims").

A script in another process runs ``Coordinator(...).capture()`` against a running afdwin (not
parked: held at a step, its shims ACTIVE), as an operator's stray tool would: every mutating op
is refused (CUI_REFUSED_PEER, naming the claim file) and the job finishes with exact evidence
(every message's bytes checked: lost=0 duplicated=0 torn=0). INSPECT stays open. While the
agent's own checkpoint holds the claim (``--leave-running``), the claim files carry its token
and pid; they are gone once it finished.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cuinterpose.coordinator.claim import read_claim
from cuinterpose.coordinator.protocol import claim_path
from cuinterpose.workloads.afdwin import demo

STEPS = 120

OUTSIDER = r"""
import json, sys
from cuinterpose.coordinator.phases import Coordinator, Participant, PhaseError
from cuinterpose.coordinator.protocol import socket_path
ctl, pids = sys.argv[1], [int(p) for p in sys.argv[2:]]
co = Coordinator([Participant(p, socket_path(ctl, p)) for p in pids], timeout_s=30)
try:
    co.capture()
    print(json.dumps({"captured": True}))
except PhaseError as e:
    print(json.dumps({
        "phase": e.phase, "changed": e.changed,
        "failures": [[f.pid, int(f.status), int(f.phase), f.message] for f in e.failures],
        "inspect_after": {p: len(rs) for p, rs in co.inspect(check_phase=True).items()},
    }))
"""


def _ranks(a) -> list[int]:
    a.wait_for(
        lambda evs: len([e for e in evs if demo.kind(e) == "window"]) == 2, 60, "both windows"
    )
    return sorted(e["pid"] for e in a.events() if demo.kind(e) == "window")


def test_a_stray_capture_of_a_running_job_is_refused_and_the_job_finishes_exactly(afdwin):
    # held at step 20 (running, its shims ACTIVE, never asked to park) however slow the machine
    a = afdwin(steps=STEPS, step_delay_ms=5, ranks=2, attention=1, hold_at=(20,))
    a.wait_hold(1)
    ranks = _ranks(a)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", OUTSIDER, str(a.ctl), *map(str, ranks)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    res = json.loads(out.stdout)
    assert (res["phase"], res["changed"]) == ("SAVE_ALLOCATIONS", False), res
    assert sorted(f[0] for f in res["failures"]) == ranks
    for pid, status, phase, message in res["failures"]:
        assert (status, phase) == (8, 0), message  # CUI_REFUSED_PEER, ACTIVE
        assert f"{claim_path(a.ctl, pid)}: no such file: no checkpoint holds this process" in (
            message
        )
    assert sorted(map(int, res["inspect_after"])) == ranks  # INSPECT stays open, all ACTIVE
    assert a.release_hold() != []
    a.wait_ok(300)
    assert demo.check_run(a.events(), STEPS, expect_restore=False) == []


def test_the_agent_holds_the_claim_only_while_it_checkpoints(afdwin, tmp_path):
    """The checkpoint's claim files name the agent (its pid, kind checkpoint) while it runs
    (read at the quiesce's ``.ready`` by a SIGSTOP of the agent) and are gone when it ends; the
    job, resumed (``--leave-running``), finishes exactly."""
    a = afdwin(steps=STEPS, step_delay_ms=5, ranks=2, attention=1, hold_at=(20,))
    a.wait_hold(1)
    ranks = _ranks(a)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cuinterpose.agent.cli",
            *a.checkpoint_args(tmp_path / "snap"),
            "--leave-running",
            "--json",
        ],
        env={
            **{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
            "CUINTERPOSE_TEST_SIGNAL_AT": "after:capture=SIGSTOP",
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        demo_wait_stopped(p.pid)
        held = {pid: read_claim(claim_path(a.ctl, pid)) for pid in ranks}
        tokens = {h[0] for h in held.values()}
        assert len(tokens) == 1 and {h[1:] for h in held.values()} == {(p.pid, "checkpoint")}
        lock = json.loads((a.ctl / f"quiesce-{a.pid}.lock").read_text())
        assert lock["claim"] == tokens.pop().hex()  # a release finds it again
    finally:
        os.kill(p.pid, 18)  # SIGCONT
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert not any(os.path.exists(claim_path(a.ctl, pid)) for pid in ranks)
    a.wait_ok(300)
    assert demo.check_run(a.events(), STEPS, expect_restore=False) == []


def demo_wait_stopped(pid: int) -> None:
    """Wait (a deadline that only catches a hang) until ``pid`` is stopped (state T)."""
    import time

    deadline = time.monotonic() + demo.HANG_S
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, f"agent pid {pid} never stopped"
        time.sleep(0.01)
