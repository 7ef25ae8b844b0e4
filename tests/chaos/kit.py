"""The chaos suite's harness: one afdwin job per fault run, the agent run with a fault, and the
judge of the two allowed outcomes (tests/chaos/tally.py, docs/testing.md "Chaos suite").

- :func:`job` starts afdwin (1 attention + 1 FFN rank on fakecuda under the shim, ``STEPS``
  steps, held at step ``HOLD`` until its first quiesce, so every fault lands mid-stream);
- :func:`agent` runs ``cuinterpose-agent ... --json`` with extra environment (the fault) and a
  deadline (``DEADLINE_S``) whose expiry is a hang, recorded and failed, not a timing assertion;
- :func:`judge` decides the outcome of one checkpoint run and records it:

  * exit 0: a complete snapshot must exist (``manifest.load`` + ``verify_images`` + the
    ``snapshots`` command list it without error) and the dumped tree is gone: ``snapshot``;
    exit 0 without one is a ``false_success``;
  * any other exit: the checkpoint must say why (a JSON error naming its phase), leave no
    manifest, and the workload must finish with exact evidence (every pair's seqs 1..STEPS,
    lost=0 duplicated=0 torn=0, exit 0): ``rolled_back``; otherwise ``lost``.

Every wait has a deadline that only catches a hang (``DEADLINE_S``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import tally

from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
from cuinterpose.workloads.afdwin import demo

STEPS, HOLD = 60, 20
#: every wait's deadline, s (a hang, never a timing assertion); CUINTERPOSE_CHAOS_DEADLINE_S overrides
DEADLINE_S = float(os.environ.get("CUINTERPOSE_CHAOS_DEADLINE_S", "120"))
#: bytes of one afdwin message (profile "ci"), counted per lost, torn or duplicated message
MESSAGE_BYTES = 16 * 64 * 2  # token_cap x hidden_size x payload_itemsize


def job(afdwin, **kw):
    """A started afdwin job, every attention rank holding at ``HOLD``."""
    args = dict(steps=STEPS, step_delay_ms=0, ranks=2, attention=1, hold_at=(HOLD,))
    args.update(kw)
    a = afdwin(**args)
    a.wait_hold(1, timeout_s=DEADLINE_S)
    return a


def agent(*args: str, env: dict | None = None, timeout_s: float = DEADLINE_S, hook: bool = False):
    """``cuinterpose-agent ARGS --json`` with ``env`` added (``hook``: through
    tests/chaos/agent_hook.py); returns (exit code, JSON or {"raw": ...}, stderr). Raises
    ``Hang`` past ``timeout_s`` (the agent is killed)."""
    e = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    e["PYTHONFAULTHANDLER"] = "1"  # SIGABRT at a hang prints every thread's stack
    e.update(env or {})
    p = subprocess.Popen(
        [sys.executable, *(HOOK if hook else ("-m", "cuinterpose.agent.cli")), *args, "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=e,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        tree = _process_group(p.pid)
        with contextlib.suppress(ProcessLookupError):  # faulthandler prints the stacks, then dies
            os.kill(p.pid, signal.SIGABRT)
        try:
            _, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            err = "(no stacks: the agent did not die on SIGABRT)"
        with contextlib.suppress(ProcessLookupError):  # the whole group may be gone
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise Hang(
            f"cuinterpose-agent {' '.join(args)} still running after {timeout_s:g} s\n"
            f"its process group:\n{tree}\nits stderr (last 8000 chars):\n{(err or '')[-8000:]}"
        ) from None
    try:
        return p.returncode, json.loads(out), err
    except ValueError:
        return p.returncode, {"raw": out + err}, err


def _process_group(pgid: int) -> str:
    """pid, state, wchan and command of every process in group ``pgid`` (what a hang waits on)."""
    rows = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or os.getpgid(int(d.name)) != pgid:
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (d / "wchan").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        rows.append(f"  {d.name} {state} {wchan or '-'} {cmd[:200]}")
    return "\n".join(rows) or "  (empty)"


class Hang(AssertionError):
    """A wait passed its deadline."""


HOOK = (str(pathlib.Path(__file__).resolve().parent / "agent_hook.py"),)


def checkpoint(a, snap, *extra, env=None, hook=False):
    return agent(*a.checkpoint_args(snap), *extra, env=env, hook=hook)


def snapshot_problem(snap: pathlib.Path) -> str:
    """'' when ``snap`` is a complete snapshot, else what is wrong with it."""
    try:
        m = manifest_mod.load(snap)
        manifest_mod.verify_images(snap, m)
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        return f"{type(e).__name__}: {e}"
    rc, out, _ = agent("snapshots", str(snap))
    rows = out.get("snapshots") or []
    if rc != 0 or len(rows) != 1 or rows[0]["error"]:
        return f"`cuinterpose-agent snapshots {snap}` exit {rc}: {out}"
    return ""


def finish(a, *, restored: bool = False, deadline_s: float | None = None) -> list[str]:
    """Let the job run to its end (held ranks released) and return the problems in its
    evidence (``demo.check_run``), [] when every pair's seqs are exactly 1..STEPS. The hold is
    released by SIGUSR1 only when no quiesce reached the job (a quiesce passes it; a SIGUSR1
    to a rank that finished would kill it)."""
    if not any(demo.kind(e) == "quiesce_requested" for e in a.events()):
        a.release_hold()
    if restored:
        code = a.wait_restored_exit(DEADLINE_S)
        if code not in (0, None):
            return [f"restored afdwin exit {code}"]
    else:
        limit = deadline_s or DEADLINE_S
        try:
            code = a.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            raise Hang(f"afdwin pid {a.pid} still running {limit:g} s after the fault") from None
        if code != 0:
            return [f"afdwin exit {code}; stderr:\n{a.stderr_tail()}"]
    return demo.check_run(a.events(), STEPS, expect_restore=restored)


def rank_pids(a) -> list[int]:
    """The rank pids of job ``a`` in rank order (its ``window`` events before any restore)."""
    ranks = {
        e["rank"]: e["pid"]
        for e in a.events()
        if demo.kind(e) == "window" and not e.get("after_restore")
    }
    return [ranks[r] for r in sorted(ranks)]


def stuck_shims(a) -> list[str]:
    """Live ranks of ``a`` whose shim is not in phase ACTIVE (``cuinterpose-agent inspect``):
    "pid P: phase X" each; a job left so after a failed checkpoint (and ``release``) is stuck."""
    out = []
    for pid in rank_pids(a):
        if not demo.pid_alive(pid):
            continue
        rc, res, _ = agent("inspect", "--pid", str(pid), "--control-dir", str(a.ctl))
        if rc != 0 and not demo.pid_alive(pid):
            continue  # it finished meanwhile: not stuck
        if rc != 0:
            out.append(f"pid {pid}: inspect exit {rc}: {res.get('error', res)}")
        elif res.get("phase") != "ACTIVE":
            out.append(f"pid {pid}: phase {res.get('phase')}")
    return out


def lost_bytes(a) -> int:
    s = [e for e in a.events() if demo.kind(e) == "summary"]
    if not s:
        return 0
    return MESSAGE_BYTES * sum(int(s[-1].get(k) or 0) for k in ("lost", "torn", "duplicated"))


def judge(
    kind: str, a, snap: pathlib.Path, rc: int, out: dict, *, deadline_s: float | None = None
) -> str:
    """Decide and record the outcome of one faulted checkpoint of job ``a`` into ``snap``;
    fails the test on a defect. Returns "snapshot" or "rolled_back"."""
    if rc == 0:
        problem = snapshot_problem(snap) if out.get("ok") is True else f"exit 0 with {out}"
        if problem:
            tally.record(kind, "false_success")
            pytest.fail(f"{kind}: exit 0 without a complete snapshot: {problem}")
        a.wait_dumped(DEADLINE_S)  # reaps the killed tree (zombies would hold its pids)
        tally.record(kind, "snapshot")
        return "snapshot"
    assert "error" in out and out["error"].get("phase"), f"{kind}: exit {rc}, no error: {out}"
    if SnapshotDir(snap).manifest_path.exists() and not snapshot_problem(snap):
        # a complete snapshot, the agent died or failed after it: the tree may be gone
        if not demo.pid_alive(a.pid):
            tally.record(kind, "snapshot")
            return "snapshot"
    stuck = stuck_shims(a)
    if stuck:
        tally.record(kind, "hang")
        pytest.fail(f"{kind}: exit {rc} ({out['error']['message']}); the job is stuck: {stuck}")
    try:
        problems = finish(a, deadline_s=deadline_s)
    except Hang:
        tally.record(kind, "hang")
        raise
    if problems:
        tally.record(kind, "lost", lost_bytes(a) or MESSAGE_BYTES)
        pytest.fail(f"{kind}: exit {rc} ({out['error']}); the workload did not survive: {problems}")
    tally.record(kind, "rolled_back", lost_bytes(a))
    return "rolled_back"


def restore_and_finish(kind: str, a, snap: pathlib.Path) -> None:
    """Restore ``snap`` for real and check the restored job's evidence (restores_seen 1)."""
    rc, out, _ = agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert (rc, out.get("ok")) == (0, True), f"{kind}: restore of {snap}: {out}"
    problems = finish(a, restored=True)
    assert problems == [], f"{kind}: restored run: {problems}"


def wait_until(pred, what: str, timeout_s: float = DEADLINE_S):
    """Poll ``pred()`` (files, /proc states: events without a pipe) until true; ``Hang`` past
    the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise Hang(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)
