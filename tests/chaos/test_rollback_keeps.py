"""Issue 23: a rolled-back process keeps everything it had. One afdwin job (held at a step
before each checkpoint) is checkpointed with a fault at each step that can fail and rolled back
each time; after every rollback, once the job holds again, each of its processes (the launcher
and both ranks) must have the same signal dispositions and masks (``/proc/PID/status``
SigCgt, SigBlk, SigIgn), the same threads (the same thread ids) and the same descriptors (number
and target), fakecuda's own allocation memfds aside: they back device memory the shim rebuilds
(a real driver holds no descriptor for it), so only their count is compared.

Also the harness kind of the group test's flake (a rank killed by SIGUSR1, status -10, after a
group rollback): ``Afdwin.release_hold`` sends nothing once every hold was consumed, since a rank
past its last hold may be in interpreter shutdown, where Python resets its handlers to SIG_DFL.
"""

from __future__ import annotations

import os
import signal

import kit
import pytest

from cuinterpose.agent.mech import signal_at
from cuinterpose.coordinator.contract import quiesce_path, read_json, write_atomic
from cuinterpose.workloads.afdwin import demo
from cuinterpose.workloads.afdwin.process_state import process_state


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp


def test_a_rollback_at_each_step_keeps_dispositions_threads_and_fds(afdwin, tmp_path, enospc):
    lib, wrapper = enospc
    faults = [
        ("SAVE_ALLOCATIONS reply lost", {"CUINTERPOSE_TEST_DROP_REPLY": "SAVE_ALLOCATIONS"}),
        *(
            (f"SIGINT after {step}", {signal_at.ENV: f"after:{step}=SIGINT"})
            for step in ("capture", "native lock", "native checkpoint", "criu dump")
        ),
        (  # CRIU's 6th write fails (ENOSPC): after it seized the tree and infected its root
            "failed CRIU dump",
            {
                "CUINTERPOSE_CRIU": str(wrapper),
                "CHAOS_ENOSPC_PREFIX": str(tmp_path),
                "CHAOS_ENOSPC_FIRST": "1",
                "CHAOS_ENOSPC_CRIU_COUNT": str(tmp_path / "criu-count"),
                "CHAOS_ENOSPC_CRIU_AT": "6",
            },
        ),
    ]
    holds = tuple(20 + 10 * i for i in range(len(faults) + 1))  # one more after the last
    a = kit.job(afdwin, steps=holds[-1] + 20, hold_at=holds)
    pids = [a.pid, *kit.rank_pids(a)]
    before = {p: process_state(p) for p in pids}
    for k, (what, env) in enumerate(faults, start=1):
        rc, out, _ = kit.checkpoint(a, tmp_path / f"snap{k}", env=env)
        assert (rc, out["error"]["outcome"]) == (4, "rolled_back"), f"{what}: {out}"
        if what == "failed CRIU dump":
            assert out["error"]["phase"] == "criu dump", out
        a.wait_hold(k + 1, timeout_s=kit.DEADLINE_S)  # resumed, and parked at the next hold
        for p in pids:
            assert process_state(p) == before[p], f"{what}: pid {p} changed"
    assert a.release_hold() != []  # the last hold: no quiesce came for it
    a.wait_ok(kit.DEADLINE_S)
    assert demo.check_run(a.events(), holds[-1] + 20, expect_restore=False) == []


def test_release_hold_never_signals_a_rank_past_its_last_hold(afdwin, monkeypatch):
    """A job held at step 20 whose quiesce came (the hold consumed): ``release_hold`` sends
    no SIGUSR1 (its rank may be finishing and have dropped the handler), and the job finishes
    exactly; before the quiesce it would have released the hold."""
    a = kit.job(afdwin)
    qid = "issue23"
    write_atomic(quiesce_path(a.ctl, a.pid, "request"), {"id": qid, "timeout_ms": 60000})
    kit.wait_until(
        lambda: (read_json(quiesce_path(a.ctl, a.pid, "ready")) or {}).get("id") == qid,
        "the job's .ready",
    )
    write_atomic(
        quiesce_path(a.ctl, a.pid, "resume"), {"id": qid, "restored": False, "cancelled": True}
    )
    sent = []
    real_kill = os.kill
    monkeypatch.setattr(
        demo.os, "kill", lambda pid, sig: sent.append((pid, sig)) or real_kill(pid, sig)
    )
    assert a.release_hold() == []
    assert [s for s in sent if s[1] == signal.SIGUSR1] == []
    assert kit.finish(a) == []
