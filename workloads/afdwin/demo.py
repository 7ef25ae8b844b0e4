"""``make demo``: afdwin checkpointed mid-stream, killed, restored, finished, on fakecuda.

``python -m cuinterpose.workloads.afdwin.demo [--steps N] [--step-delay-ms MS] [--run-dir DIR]``

1. starts afdwin (2 ranks: 1 attention, 1 FFN) under the shim on fakecuda: its own session
   (setsid), stdout (JSON lines) to ``RUN/afdwin.log``, ``LD_PRELOAD=<shim>``,
   ``LD_LIBRARY_PATH=<fakecuda dir>``, a private ``CUINTERPOSE_CONTROL_DIR=RUN/ctl``;
2. waits until messages flow, then runs ``cuinterpose-agent checkpoint --driver fake`` (the CRIU
   dump kills the tree);
3. runs ``cuinterpose-agent restore``; the restored tree continues and finishes;
4. checks the evidence in the log: for every (sender, receiver) pair seqs exactly 1..N, nothing
   lost, duplicated or torn, and every window/peer VA identical before and after the cut.

The last line is ``demo: PASS ...`` (exit 0) or ``demo: FAIL <reason>`` (exit 1).

The helpers here (:class:`Afdwin`, :func:`run_agent`, :func:`check_run`) are also what the
end-to-end tests in tests/e2e use.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

from cuinterpose.agent import paths
from cuinterpose.agent.mech.census import pid_alive  # noqa: F401  (tests use demo.pid_alive)

PR_SET_CHILD_SUBREAPER = 36
HANG_S = 600.0  # deadlines that only catch a hang: minutes, for a loaded machine


def set_subreaper() -> bool:
    """Make this process the child subreaper, so a CRIU-restored tree (whose restorer exits) is
    re-parented to us and can be waited for. Returns False if prctl failed."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def reap_zombies() -> list[tuple[int, int]]:
    """Reap every exited child without blocking; returns [(pid, wait status)]."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, status))


def workload_env(
    control_dir: os.PathLike | str, *, shim: bool = True, driver: str = "fake"
) -> dict:
    """Environment for a workload under the shim with a private control dir, on fakecuda
    (``driver="fake"``) or on the system's real ``libcuda.so.1`` (``driver="real"``: the
    inherited ``LD_LIBRARY_PATH`` is kept, fakecuda's directory removed from it)."""
    if driver not in ("fake", "real"):
        raise ValueError(f"driver must be 'fake' or 'real', not {driver!r}")
    env = paths.real_driver_env()
    if shim:
        env["LD_PRELOAD"] = str(paths.shim_path())
    if driver == "fake":
        env["LD_LIBRARY_PATH"] = str(paths.fakecuda_dir())
    env["CUINTERPOSE_CONTROL_DIR"] = str(control_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Afdwin:
    """One afdwin run: ``start()`` launches it (setsid, stdout to ``log``), ``events()`` parses
    the JSON lines so far, ``wait_for(pred)`` polls them."""

    def __init__(
        self,
        run_dir: os.PathLike | str,
        *,
        ranks: int = 2,
        attention: int = 1,
        steps: int = 400,
        ring_depth: int = 2,
        step_delay_ms: float = 5.0,
        extra_args: tuple = (),
        driver: str = "fake",
        hold_at: tuple = (),
    ):
        self.run_dir = pathlib.Path(run_dir).resolve()
        self.ctl = self.run_dir / "ctl"
        if len(str(self.ctl)) > 80:  # keep <ctl>/cuinterpose-<pid>.sock under 108 bytes
            import tempfile

            self.ctl = pathlib.Path(tempfile.mkdtemp(prefix="cui-ctl-"))
        self.log = self.run_dir / "afdwin.log"
        self.err = self.run_dir / "afdwin.err"
        self.steps = steps
        self.driver = driver
        self.args = [
            "--ranks",
            str(ranks),
            "--attention",
            str(attention),
            "--steps",
            str(steps),
            "--ring-depth",
            str(ring_depth),
            "--step-delay-ms",
            str(step_delay_ms),
            *(("--hold-at", ",".join(map(str, hold_at))) if hold_at else ()),
            *extra_args,
        ]
        self.attention = attention
        self.hold_at = tuple(hold_at)
        #: holds ended by :meth:`release_hold` (SIGUSR1) so far
        self.holds_released = 0
        self.proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "Afdwin":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ctl.mkdir(mode=0o700, exist_ok=True)  # a control dir is private (case 012)
        # O_APPEND: CRIU refuses to restore a file whose size changed since the dump unless it
        # is opened for appending, and the log grows while the restored run goes on, so
        # without it a snapshot could be restored only once (docs/criu.md).
        with open(self.log, "ab") as out, open(self.err, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cuinterpose.workloads.afdwin", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=self.run_dir,
                env=workload_env(self.ctl, driver=self.driver),
                start_new_session=True,
            )
        return self

    def events(self, offset: int = 0) -> list[dict]:
        """Every complete JSON line of the log from byte ``offset`` on (non-JSON lines are
        skipped); [] before the log exists."""
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                data = f.read().decode(errors="replace")
        except FileNotFoundError:
            return []
        out = []
        for line in data.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def explain(self) -> str:
        """Why a run ended as it did: its ``error`` events, the summary's ``problems`` and
        ``exit_codes``, each rank's ``done`` verdict, and the stderr tail (text for an assertion
        message)."""
        lines = []
        for e in self.events():
            k = kind(e)
            if k == "error":
                lines.append(f"error: {json.dumps(e, sort_keys=True)}")
            elif k == "summary":
                lines.append(
                    f"summary: ok={e.get('ok')} problems={e.get('problems')} "
                    f"exit_codes={e.get('exit_codes')}"
                )
            elif k == "done" and not e.get("ok", True):
                lines.append(f"rank {e.get('rank')} not ok: {json.dumps(e, sort_keys=True)[:2000]}")
        return "\n".join(lines + ["stderr:", self.stderr_tail(40)])

    def wait_ok(self, timeout_s: float = 300) -> None:
        """Wait for the launcher (our child) to exit; ``AssertionError`` carrying
        :meth:`explain` unless it exited 0 (``subprocess.TimeoutExpired`` after ``timeout_s``)."""
        rc = self.proc.wait(timeout=timeout_s)
        assert rc == 0, f"afdwin (pid {self.pid}) exited {rc}:\n{self.explain()}"

    def stderr_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.err.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def wait_for(
        self, pred: Callable[[list[dict]], bool], timeout_s: float, what: str
    ) -> list[dict]:
        """Poll ``events()`` until ``pred(events)``; raises ``RuntimeError`` naming ``what`` on
        timeout or if the tree exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            ev = self.events()
            if pred(ev):
                return ev
            if not pid_alive(self.pid) and (
                self.proc.poll() is not None or not pid_alive(self.pid)
            ):
                ev = self.events()
                if pred(ev):
                    return ev
                raise RuntimeError(f"afdwin exited before {what}; stderr:\n{self.stderr_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.05)

    def wait_hold(self, k: int = 1, timeout_s: float = HANG_S) -> int:
        """(``hold_at``) Wait until every attention rank holds at ``hold_at[k - 1]`` (its
        ``hold`` event: every step up to it complete, the next one waiting for quiesce ``k``),
        so a checkpoint now cuts exactly there. Returns that step."""
        step = self.hold_at[k - 1]
        self.wait_for(
            lambda ev: len(holds(ev, step)) == self.attention,
            timeout_s,
            f"every attention rank to hold at step {step}",
        )
        return step

    def checkpoint_args(self, images_dir) -> list[str]:
        """The ``cuinterpose-agent`` arguments that checkpoint this job on its driver into
        ``images_dir`` through its control dir (for runners other than :meth:`checkpoint`)."""
        return [
            "checkpoint",
            "--pid",
            str(self.pid),
            "--images-dir",
            str(images_dir),
            "--driver",
            self.driver,
            "--control-dir",
            str(self.ctl),
        ]

    def checkpoint(self, images_dir, *extra: str, timeout_s: float = 300) -> tuple[int, dict]:
        """``cuinterpose-agent checkpoint`` of this job on its driver into ``images_dir`` (its
        control dir; ``extra``: more options): :func:`run_agent`'s (exit code, JSON)."""
        return run_agent(*self.checkpoint_args(images_dir), *extra, timeout_s=timeout_s)

    def release_hold(self) -> list[int]:
        """End the current hold of every attention rank without a quiesce (SIGUSR1), for a run
        whose checkpoint was refused before the workload saw it. Once every hold is consumed
        (by quiesces the job saw, ``quiesce_requested`` events, and earlier releases) nothing is
        sent: a rank past its last hold may be finishing, and a Python process resets its
        handlers to SIG_DFL during interpreter shutdown, so a SIGUSR1 then kills it (issue 23:
        a group test's rank 0 died of one, status -10, after a rollback). A rank with a hold
        still ahead cannot have finished, so it still has the handler. Returns the pids
        signalled."""
        evs = self.events()
        quiesces = sum(1 for e in evs if kind(e) == "quiesce_requested")
        if quiesces + self.holds_released >= len(self.hold_at):
            return []
        sent = []
        for e in evs:
            attention = e.get("rank", self.attention) < self.attention
            if kind(e) == "window" and attention and not e.get("after_restore"):
                try:
                    os.kill(e["pid"], signal.SIGUSR1)
                    sent.append(e["pid"])
                except ProcessLookupError:
                    pass
        self.holds_released += 1
        return sent

    def wait_dumped(self, timeout_s: float = HANG_S) -> int:
        """After the agent killed the dumped tree (once the snapshot was written): reap our child
        (the root), then keep reaping until every rank pid of the run is gone, so a restore
        finds the pids free (ranks re-parented to us as subreaper may die after the root and
        would otherwise linger as zombies). Returns the root's wait status; raises
        ``RuntimeError`` naming the pids still present after ``timeout_s``."""
        self.proc.wait(timeout=timeout_s)
        ranks = {e["pid"] for e in self.events() if kind(e) == "window" and "pid" in e}
        deadline = time.monotonic() + timeout_s
        while True:
            reap_zombies()
            left = sorted(p for p in ranks if os.path.exists(f"/proc/{p}"))
            if not left:
                return self.proc.returncode
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank pids {left} still present {timeout_s:g} s after the "
                    "dumped tree was killed"
                )
            time.sleep(0.02)

    def wait_restored_exit(self, timeout_s: float) -> Optional[int]:
        """Wait for the restored root to exit. Returns its exit code when it is our child (we are
        the subreaper), else None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = -1, None
            if pid == self.pid:
                return os.waitstatus_to_exitcode(status)
            if pid == -1 and not pid_alive(self.pid):
                return None
            time.sleep(0.05)
        raise RuntimeError(f"restored afdwin (pid {self.pid}) still running after {timeout_s:g} s")

    def kill(self) -> None:
        """SIGKILL the whole session (best effort) and reap."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except Exception:
                pass
        reap_zombies()


def run_agent(*args: str, timeout_s: float = 300, env: dict | None = None) -> tuple[int, dict]:
    """Run ``cuinterpose-agent ARGS --json`` (as ``python -m cuinterpose.agent.cli``) without
    LD_PRELOAD, with ``env`` added to the environment; returns (exit code, parsed JSON or
    {"raw": stdout+stderr})."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | (env or {})
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", *args, "--json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )
    try:
        return res.returncode, json.loads(res.stdout)
    except ValueError:
        return res.returncode, {"raw": res.stdout + res.stderr}


def wait_stopped(pid: int, alive: Callable[[], bool], timeout_s: float = HANG_S) -> None:
    """Wait until ``pid`` is stopped by a signal (state ``T`` in /proc/PID/stat: an agent run
    with ``CUINTERPOSE_TEST_SIGNAL_AT=WHEN:STEP=SIGSTOP`` reached that point); while
    ``alive()`` holds. ``RuntimeError`` when ``alive()`` turns false or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        if not alive():
            raise RuntimeError(f"pid {pid} ended its run before it stopped itself")
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} did not stop itself within {timeout_s:g} s")
        time.sleep(0.01)


def fake_gpu_uuid(i: int) -> str:
    """The UUID fakecuda gives device ``i`` of ``FAKECUDA_DEVICES`` (docs/fakecuda.md: the
    bytes ``fakecudaGPU-uu`` + ``i`` big-endian in two bytes), as nvidia-smi writes it."""
    from cuinterpose.agent.mech.devicemap import uuid_str

    return uuid_str(b"fakecudaGPU-uu" + i.to_bytes(2, "big"))


def snapshot_digest(d) -> dict:
    """{relative path: (sha256 or "dir", mode, mtime_ns)} for every file and directory under
    ``d`` (links not followed): equal before and after means the snapshot was not touched."""
    import hashlib

    out = {}
    for p in sorted(pathlib.Path(d).rglob("*")):
        st = p.lstat()
        h = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(d))] = (h, st.st_mode, st.st_mtime_ns)
    return out


def holds(evs: list[dict], step: int) -> set[int]:
    """Attention ranks that sent a ``hold`` event for ``step`` (--hold-at)."""
    return {e["rank"] for e in evs if kind(e) == "hold" and e.get("step") == step}


def kind(ev: dict) -> Optional[str]:
    return ev.get("event") or ev.get("type")


def received(evs: list[dict]) -> int:
    """Messages the FFN ranks received so far (newest ``progress`` event of each FFN rank)."""
    last: dict = {}
    for e in evs:
        if kind(e) == "progress" and e.get("role") == "ffn":
            last[e.get("rank")] = e
    return sum(int(e.get("received", 0)) for e in last.values())


def cut_seqs(evs: list[dict]) -> dict:
    """{(src, dst): last seq received before the cut} from the last ``quiesced`` event (FFN
    ranks' ``last_seq``: the messages delivered before the checkpoint)."""
    q = [e for e in evs if kind(e) == "quiesced"]
    if not q:
        return {}
    out = {}
    for r in q[-1].get("ranks", []):
        if r.get("role") == "ffn":
            for src, seq in (r.get("last_seq") or {}).items():
                out[(int(src), int(r["rank"]))] = int(seq)
    return out


def va_table(evs: list[dict], after_restore: bool) -> dict:
    """{rank: (base_va, [peer_va...])} from the ``window`` events before or after restore."""
    out = {}
    for e in evs:
        if kind(e) == "window" and bool(e.get("after_restore")) == after_restore:
            out[e.get("rank")] = (e.get("base_va"), list(e.get("peer_va") or []), e.get("mc_va"))
    return out


def check_run(
    evs: list[dict], steps: int, *, attention: int = 1, ffn: int = 1, expect_restore: bool = True
) -> list[str]:
    """Problems in a finished afdwin log (empty list = all good): every (sender, receiver) pair
    got seqs exactly 1..steps (count, distinct, first, last, no gaps/duplicates/torn), the
    launcher summary says lost=0 duplicated=0 torn=0, and (``expect_restore``) the VA table
    after restore equals the one before."""
    problems = []
    summary = [e for e in evs if kind(e) == "summary"]
    if not summary:
        problems.append("no summary event (afdwin did not finish)")
    else:
        s = summary[-1]
        for k in ("lost", "duplicated", "torn"):
            if s.get(k) != 0:
                problems.append(f"summary {k}={s.get(k)}")
        if s.get("ok") is not True:
            problems.append(f"summary not ok: {s.get('problems')}")
        if expect_restore and s.get("restores_seen") != 1:
            problems.append(f"summary restores_seen={s.get('restores_seen')}, expected 1")
    pairs = []
    for e in evs:
        if kind(e) == "done":
            for p in e.get("pairs", e.get("per_pair", [])) or []:
                pairs.append(p)
    if len(pairs) < attention * ffn:
        problems.append(
            f"{len(pairs)} per-pair records in done events, expected >= {attention * ffn}"
        )
    for p in pairs:
        who = f"pair {p.get('src', p.get('sender'))}->{p.get('dst', p.get('receiver'))}"
        want = {
            "count": steps,
            "distinct": steps,
            "first": 1,
            "last": steps,
            "gaps": 0,
            "duplicates": 0,
            "torn": 0,
        }
        for k, v in want.items():
            if k in p and p[k] != v:
                problems.append(f"{who}: {k}={p[k]}, expected {v}")
    before = va_table(evs, False)
    if not before:
        problems.append("no window event")
    if expect_restore:
        after = va_table(evs, True)
        if not after:
            problems.append("no window event after restore")
        elif after != before:
            problems.append(f"VA table changed across restore: before {before}, after {after}")
    return problems


def fmt_phases(phases: list[dict]) -> str:
    from cuinterpose.agent.run.report import fmt_ns

    return ", ".join(f"{p['name']} {fmt_ns(p['elapsed_ns'])}" for p in phases)


GROUPS = {
    "INSPECT": "shim",
    "SAVE_ALLOCATIONS": "shim",
    "PREPARE_UNICAST": "shim",
    "LOAD_ALLOCATIONS": "shim",
    "RESTORE_UNICAST": "shim",
    "CANCEL_CAPTURE": "shim",
    "native lock": "native",
    "native checkpoint": "native",
    "native restore": "native",
    "native unlock": "native",
    "criu dump": "criu",
    "criu restore": "criu",
    "kill dumped": "criu",
    "resume trees": "criu",
    "quiesce": "quiesce",
}


def fmt_groups(phases: list[dict]) -> str:
    """ "total T (quiesce a, shim b, native c, criu d, other e)" from a phase list."""
    from cuinterpose.agent.run.report import fmt_ns

    sums: dict[str, int] = {}
    for p in phases:
        g = GROUPS.get(p["name"], "other")
        sums[g] = sums.get(g, 0) + int(p["elapsed_ns"])
    order = [g for g in ("quiesce", "shim", "native", "criu", "other") if g in sums]
    return (
        f"{fmt_ns(sum(sums.values()))} (" + ", ".join(f"{g} {fmt_ns(sums[g])}" for g in order) + ")"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cuinterpose.workloads.afdwin.demo", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--step-delay-ms", type=float, default=5.0)
    ap.add_argument(
        "--cut-after", type=int, default=60, help="checkpoint once this many messages were received"
    )
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)

    os.environ.pop("LD_PRELOAD", None)
    repo = pathlib.Path(__file__).resolve().parents[2]
    run_dir = pathlib.Path(
        args.run_dir or repo / "demo-run" / time.strftime("%Y%m%d-%H%M%S")
    ).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    snap = run_dir / "snapshot"
    set_subreaper()

    def fail(reason: str) -> int:
        print(f"demo: FAIL {reason}", flush=True)
        return 1

    try:
        from cuinterpose.agent.mech import criu

        ok, out = criu.check()
        if not ok:
            return fail(
                f"CRIU is not usable here (`make criu`): {out.strip().splitlines()[-1] if out.strip() else ''}"
            )
    except Exception as e:
        return fail(f"CRIU is not usable here: {e}")

    afd = Afdwin(run_dir, steps=args.steps, step_delay_ms=args.step_delay_ms)
    print(f"demo: run dir {run_dir}")
    print(
        f"demo: starting afdwin (1 attention + 1 FFN rank, {args.steps} steps) on fakecuda "
        f"under {paths.shim_path()}"
    )
    afd.start()
    try:
        afd.wait_for(lambda ev: received(ev) >= args.cut_after, 120, f"{args.cut_after} messages")
        print(f"demo: afdwin pid {afd.pid} is streaming; checkpointing to {snap}")
        rc, cp = run_agent(
            "checkpoint",
            "--pid",
            str(afd.pid),
            "--images-dir",
            str(snap),
            "--driver",
            "fake",
            "--control-dir",
            str(afd.ctl),
        )
        if rc != 0 or not cp.get("ok"):
            err = cp.get("error", {}).get("message") or cp.get("raw", "")
            return fail(f"checkpoint failed (exit {rc}): {err}")
        status = afd.wait_dumped()
        evs = afd.events()
        cut = cut_seqs(evs)
        before_cut = sum(cut.values())
        if not cut or not 0 < before_cut < args.steps:
            return fail(f"the cut is not mid-stream: last seqs before the dump {cut}")
        print(f"demo: checkpoint done in {fmt_phases(cp['phases'])}")
        print(
            f"demo: tree dumped, then killed once the snapshot was written (root exit status "
            f"{status}); "
            f"{before_cut} messages received before the cut"
        )
        rc, rs = run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
        if rc != 0 or not rs.get("ok"):
            err = rs.get("error", {}).get("message") or rs.get("raw", "")
            return fail(f"restore failed (exit {rc}): {err}")
        print(f"demo: restore done in {fmt_phases(rs['phases'])}")
        code = afd.wait_restored_exit(300)
        evs = afd.events()
        problems = check_run(evs, args.steps)
        if code not in (0, None):
            problems.insert(0, f"restored afdwin exited with {code}")
        total = sum(
            int(p.get("count", 0))
            for e in evs
            if kind(e) == "done" and e.get("role") == "ffn"
            for p in e.get("pairs", [])
        )
        if problems:
            return fail("; ".join(problems[:5]))
        vas = va_table(evs, False)
        print(
            f"demo: afdwin finished after restore: {total} messages in total, "
            f"{total - before_cut} after the cut"
        )
        print(
            "demo: VA table identical before/after: "
            + ", ".join(
                f"rank {r}: base {v[0]:#x} peers {[hex(x) for x in v[1]]}"
                if isinstance(v[0], int)
                else f"rank {r}: base {v[0]} peers {v[1]}"
                for r, v in sorted(vas.items(), key=lambda kv: str(kv[0]))
            )
        )
        print(
            f"demo: PASS messages before cut={before_cut} after cut={total - before_cut} "
            f"lost=0 duplicated=0 torn=0 VAs identical; checkpoint {fmt_groups(cp['phases'])}; "
            f"restore {fmt_groups(rs['phases'])}",
            flush=True,
        )
        return 0
    except Exception as e:
        return fail(f"{e}")
    finally:
        if afd.proc is not None and afd.proc.poll() is None:
            afd.kill()
        if pid_alive(afd.pid):
            try:
                os.killpg(afd.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        reap_zombies()


if __name__ == "__main__":
    sys.exit(main())
