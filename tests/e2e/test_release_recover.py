"""Case 009 (and case 006 from outside): the agent SIGKILLed mid-checkpoint at an exact point
(``CUINTERPOSE_TEST_SIGNAL_AT``, no sleep), then ``cuinterpose-agent release`` rolls back what
the dead agent left: afdwin 1A1F on fakecuda under the shim, real CRIU. Asserted: the release
report (the phase each shim was found in, each process's native state, what was undone), that
no CRIU is left tracing the tree, that the images directory holds no partial dump, and that
afdwin then completes with every message exactly once (lost=0 duplicated=0 torn=0, exit 0)."""

from __future__ import annotations

import json
import os
import pathlib
import signal

import pytest
from test_e2e_afdwin import assert_exact_pairs, windows

from cuinterpose.agent.mech import signal_at
from cuinterpose.workloads.afdwin import demo

STEPS, HOLD = 120, 30


def _tracer(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


P2, S2 = [["PREPARED", "PREPARED"]], [["SAVED", "SAVED"], ["SAVED", "ACTIVE"], ["ACTIVE", "SAVED"]]
# (the trigger, the phases the two ranks' shims may be found in, their native state, a dump ran)
CASES = [
    ("after:capture", P2, "RUNNING", False),
    ("after:native checkpoint", P2, "CHECKPOINTED", False),
    ("during:criu dump", P2, "CHECKPOINTED", True),
    # case 006: killed at the first SAVE_ALLOCATIONS reply: the other rank's reply is lost
    # (it saved; on a loaded machine its request may not have gone out yet: ACTIVE)
    ("during:capture", S2, "RUNNING", False),
]


def _refused_naming_release(a, ranks: list[int], lock: dict, tmp_path: pathlib.Path) -> None:
    """A job parked by a dead agent: the next checkpoint (exit 3, nothing created) and an
    inspect of a rank (phase INSPECT) are refused, naming the dead agent, its request and the
    ``release`` to run."""
    rc, again = a.checkpoint(tmp_path / "again")
    assert rc == 3 and again["error"]["outcome"] == "refused", again
    assert (
        f"`cuinterpose-agent release --pid {a.pid} --control-dir {a.ctl}`"
        in (again["error"]["reason"])
    ), again
    assert not (tmp_path / "again").exists()
    rc, ins = demo.run_agent(
        "inspect", "--pid", str(ranks[0]), "--control-dir", str(a.ctl), "--driver", "fake"
    )
    assert rc == 3 and ins["error"]["phase"] == "INSPECT", ins
    assert ins["error"]["reason"].startswith(
        f"the agent (pid {lock['pid']}) that ran a checkpoint of root {a.pid} died (request id "
        f"{lock['id']}), leaving it parked: run `cuinterpose-agent release --pid {a.pid} "
        f"--control-dir {a.ctl}`; INSPECT refused"
    ), ins


@pytest.mark.parametrize(
    "trigger,phases,native_state,dumped", CASES, ids=[c[0].replace(" ", "-") for c in CASES]
)
def test_release_rolls_back_a_dead_agents_checkpoint(
    afdwin, tmp_path, monkeypatch, trigger, phases, native_state, dumped
):
    a = afdwin(steps=STEPS, step_delay_ms=2, hold_at=(HOLD,))
    a.wait_hold()
    ranks = sorted(w["pid"] for w in windows(a.events()).values())
    snap = tmp_path / "snap"
    monkeypatch.setenv(signal_at.ENV, trigger)
    rc, out = a.checkpoint(snap)
    monkeypatch.delenv(signal_at.ENV)
    assert rc == -signal.SIGKILL, out
    lock = json.loads((a.ctl / f"quiesce-{a.pid}.lock").read_text())
    assert lock["torn_down"] is True and lock["roots"] == [a.pid]
    assert lock["cuda_pids"] == ranks and [p for p, _ in lock["participants"]] == ranks
    assert sorted(int(p) for p in lock["records"]["by_pid"]) == ranks
    step = trigger.split(":", 1)[1]
    teardown = [
        "capture done",
        "native lock",
        "native lock done",
        "native checkpoint",
        "native checkpoint done",
        "criu dump",
        f"criu dump {a.pid}",
    ]
    # the steps the lock says were started and done when the agent died
    upto = {"capture": 1, "native checkpoint": 5, "criu dump": 7}
    want_steps = ["quiescence check", "quiescence check done", "capture", "first INSPECT"]
    if trigger != "during:capture":
        want_steps += teardown[: upto[step]]
    assert lock["steps"] == want_steps
    # killed mid-dump: CRIU had seized the tree and written its log (release removes it all)
    assert (snap / "criu" / str(a.pid) / "dump.log").is_file() is dumped

    # the next checkpoint and an inspect are refused naming the release (docs/agent.md)
    _refused_naming_release(a, ranks, lock, tmp_path)

    rc, rel = demo.run_agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
    assert rc == 0 and rel["ok"], rel
    found = rel["found"]
    assert sorted(int(p) for p in found["shims"]) == ranks
    assert [found["shims"][str(p)] for p in ranks] in phases, found
    assert found["native"] == {str(p): native_state for p in ranks}
    assert (rel["outcome"], rel["request_id"], rel["steps"]) == (
        "rolled_back",
        lock["id"],
        want_steps,
    )
    assert rel["snapshot"] == {
        "images_dir": str(snap),
        "complete": False,
        "why": "no manifest was written",
        "kept": False,
        "restore": None,
    }
    assert rel["resume"] == str(a.ctl / f"quiesce-{a.pid}.resume")
    # nothing traces the tree any more (CRIU died with its agent, or release killed it)
    assert [_tracer(p) for p in [a.pid, *ranks]] == [0] * (1 + len(ranks))
    if not dumped:
        assert (found["criu"], found["stopped"]) == ([], [])
    assert not (snap / "criu").exists() and not (snap / "manifest.json").exists()
    # no lock, no request: only the sockets (and the workload's .ready and the .resume until
    # the workload has read it and removed both)
    assert set(os.listdir(a.ctl)) - {f"quiesce-{a.pid}.resume", f"quiesce-{a.pid}.ready"} == {
        f"cuinterpose-{p}.sock" for p in ranks
    }

    # the text report (the same facts, in words) from the JSON: one line per thing undone
    from cuinterpose.agent.run import recover

    text = recover.render(rel)
    shims = ", ".join(f"pid {p} {found['shims'][str(p)]}" for p in ranks)
    assert text.splitlines()[4] == f"  shims: {shims} -> ACTIVE, topology equal to the capture"
    assert text.splitlines()[3] == (
        "  native: " + ", ".join(f"pid {p} {native_state}" for p in ranks) + " -> RUNNING"
    )

    a.wait_ok(300), a.stderr_tail()
    evs = a.events()
    s = assert_exact_pairs(evs, STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 1)
    resumed = [e for e in evs if demo.kind(e) == "resumed"]
    assert [(e["restored"], e["cancelled"]) for e in resumed] == [(False, False)]


def test_release_after_the_manifest_keeps_the_snapshot_and_resumes_the_workload(
    afdwin, tmp_path, monkeypatch
):
    """Killed once the manifest is on disk (before the dumped tree is killed): the snapshot is
    complete, so release keeps it and says how to restore it; the tree CRIU left stopped is
    continued and rolled back, and afdwin finishes."""
    a = afdwin(steps=STEPS, step_delay_ms=2, hold_at=(HOLD,))
    a.wait_hold()
    ranks = sorted(w["pid"] for w in windows(a.events()).values())
    snap = tmp_path / "snap"
    monkeypatch.setenv(signal_at.ENV, "after:manifest")
    rc, out = a.checkpoint(snap)
    monkeypatch.delenv(signal_at.ENV)
    assert rc == -signal.SIGKILL, out
    lock = json.loads((a.ctl / f"quiesce-{a.pid}.lock").read_text())
    assert lock["steps"][-7:] == [
        "criu dump",
        f"criu dump {a.pid}",
        "criu dump done",
        "sync",
        "sync done",
        "manifest",
        "manifest done",
    ]
    # the next checkpoint and an inspect are refused naming the release (docs/agent.md)
    _refused_naming_release(a, ranks, lock, tmp_path)

    rc, rel = demo.run_agent("release", "--pid", str(a.pid), "--control-dir", str(a.ctl))
    assert rc == 0 and rel["ok"], rel
    found = rel["found"]
    assert found["criu"] == []
    assert sorted(found["stopped"]) == sorted([a.pid, *ranks])  # CRIU's --leave-stopped
    assert found["native"] == {str(p): "CHECKPOINTED" for p in ranks}
    assert found["shims"] == {str(p): "PREPARED" for p in ranks}
    assert rel["snapshot"] == {
        "images_dir": str(snap),
        "complete": True,
        "why": "",
        "kept": True,
        "restore": f"cuinterpose-agent restore --images-dir {snap}",
    }
    assert (snap / "manifest.json").is_file() and (snap / "criu").is_dir()
    from cuinterpose.agent.run import recover

    assert recover.render(rel).splitlines()[-1] == (
        f"  snapshot: complete in {snap}, kept: `cuinterpose-agent restore --images-dir {snap}` "
        "restores it once the workload is gone"
    )
    a.wait_ok(300), a.stderr_tail()
    s = assert_exact_pairs(a.events(), STEPS)
    assert (s["restores_seen"], s["quiesces"]) == (0, 1)
