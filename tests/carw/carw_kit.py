"""The harness of the carw tests: one carw run on fakecuda (``Carw``), the agent around it
(``demo.run_agent``), and the checks of a finished run's log (``check_finished``).

Every wait is on an event (a line in the log, a pid gone); deadlines only catch a hang.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from cuinterpose.agent.mech import procfs
from cuinterpose.workloads import stacks
from cuinterpose.workloads.afdwin import demo

HANG_S = 600.0
#: seconds a wait for one event of a live run may take before it counts as a hang: below the
#: suite's per-test timeout (600 s, pyproject.toml), so the failure carries the run's own log
EVENT_HANG_S = 300.0


class Carw:
    """``python -m cuinterpose.workloads.carw ARGS`` in its own session, stdout (JSON lines) to
    ``run_dir/carw.log`` opened for appending (a restored tree keeps writing it), under the shim
    (``shim=True``) on fakecuda (``driver="fake"``) or the real driver (``"real"``), with a
    private control directory. Subclasses (tests/tmsh/tmsh_kit.py) run another workload module
    with the same harness."""

    module = "cuinterpose.workloads.carw"
    event_hang_s = EVENT_HANG_S

    def __init__(
        self,
        run_dir,
        *,
        ranks: int = 2,
        steps: int = 40,
        hold_at: tuple = (),
        step_delay_ms: float = 0,
        elems: int = 64,
        shim: bool = True,
        share: str = "ipc",
        env: Optional[dict] = None,
        extra: tuple = (),
        driver: str = "fake",
    ):
        self.run_dir = pathlib.Path(run_dir).resolve()
        self.ctl = self.run_dir / "ctl"
        if len(str(self.ctl)) > 80:  # keep <ctl>/cuinterpose-<pid>.sock under 108 bytes
            self.ctl = pathlib.Path(tempfile.mkdtemp(prefix="cui-ctl-"))
        self.log = self.run_dir / "carw.log"
        self.err = self.run_dir / "carw.err"
        self.ranks, self.steps, self.shim, self.share = ranks, steps, shim, share
        self.extra_env = dict(env or {})
        self.driver = driver
        self.args = [
            "--ranks",
            str(ranks),
            "--steps",
            str(steps),
            "--elems",
            str(elems),
            "--step-delay-ms",
            str(step_delay_ms),
            "--share",
            share,
            *(("--hold-at", ",".join(map(str, hold_at))) if hold_at else ()),
            *extra,
        ]
        self.proc: Optional[subprocess.Popen] = None
        self.stacks_dir = str(self.run_dir / "stacks")
        self.stacks: dict[int, str] = {}  # by pid, once dump_stacks ran

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "Carw":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ctl.mkdir(mode=0o700, exist_ok=True)
        env = demo.workload_env(self.ctl, shim=self.shim, driver=self.driver)
        env[stacks.DIR_VAR] = self.stacks_dir
        env.update(self.extra_env)
        with open(self.log, "ab") as out, open(self.err, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=self.run_dir,
                env=env,
                start_new_session=True,
            )
        return self

    def events(self) -> list[dict]:
        try:
            data = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        out = []
        for line in data.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
        return out

    def of(self, kind: str, **match) -> list[dict]:
        return [
            e
            for e in self.events()
            if e.get("event") == kind and all(e.get(k) == v for k, v in match.items())
        ]

    def stderr_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.err.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def wait_for(
        self, pred: Callable[[list[dict]], bool], what: str, *, stop_on_failed: bool = True
    ) -> list[dict]:
        """The run's events once ``pred`` holds. Raises ``RuntimeError`` with the run's last
        events and stderr when the run exits first, a process of it reports ``failed`` (a rank
        that gave up leaves the others waiting for it), or after ``event_hang_s``
        (:data:`EVENT_HANG_S` unless a subclass says less)."""
        deadline = time.monotonic() + self.event_hang_s
        while True:
            ev = self.events()
            if pred(ev):
                return ev
            why = None
            if not demo.pid_alive(self.pid):
                ev = self.events()
                if pred(ev):
                    return ev
                why = "exited"
            elif stop_on_failed and any(e.get("event") == "failed" for e in ev):
                why = "reported a failure"
            elif time.monotonic() > deadline:
                why = f"did not get there within {self.event_hang_s:g} s"
                self.dump_stacks()
            if why:
                raise RuntimeError(f"{self.module} {why} before {what}; {self.story(ev)}")
            time.sleep(0.05)

    def story(self, ev: list[dict], n: int = 12) -> str:
        """The last ``n`` events and stderr lines of the run and the stacks :meth:`dump_stacks`
        collected, for a failure message."""
        last = "\n".join(json.dumps(e)[:300] for e in ev[-n:])
        st = "".join(f"\nstacks of pid {p}:\n{t}" for p, t in sorted(self.stacks.items()))
        return f"last events:\n{last}\nstderr:\n{self.stderr_tail(120)}{st}"

    def dump_stacks(self) -> dict[int, str]:
        """Make every workload process of the run write its threads' Python stacks, each to its
        own file (``SIGUSR2``, ``CUI_STACKS_DIR``: workloads/stacks.py), and return what the
        files hold by pid once each has its "Current thread" and stopped growing (at most 10 s:
        for a failure message; :meth:`stacks_of` waits for a given frame). multiprocessing's
        resource tracker, which has no such handler, is left alone."""
        sent = []
        for pid in _session(self.pid):
            try:
                cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"resource_tracker" not in cmd:
                    os.kill(pid, stacks.SIGNAL)
                    sent.append(pid)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
        got: dict[int, str] = {}
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            now = {p: self._stack_file(p) for p in sent}
            if all("Current thread" in t for t in now.values()) and now == got:
                break
            got = now
            time.sleep(0.1)
        self.stacks = {p: t for p, t in got.items() if t}
        return self.stacks

    def _stack_file(self, pid: int) -> str:
        try:
            return pathlib.Path(stacks.path_of(self.stacks_dir, pid)).read_text()
        except FileNotFoundError:
            return ""

    def stacks_of(self, pid: int, needle: str) -> str:
        """The stacks file of ``pid`` once it holds ``needle`` (a hang after
        ``event_hang_s`` raises)."""
        deadline = time.monotonic() + self.event_hang_s
        while needle not in (text := self._stack_file(pid)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {needle!r} in the stacks of pid {pid}:\n{text}")
            time.sleep(0.05)
        return text

    def finish(self) -> Optional[int]:
        """Until the run printed its summary (a failed rank ends the run with one too: the
        launcher stops the others), then its exit code (:meth:`wait_exit`). Raises with the
        run's story (:meth:`wait_for`) when it exits without one or hangs."""
        self.wait_for(
            lambda ev: any(e.get("event") == "summary" for e in ev),
            "its summary",
            stop_on_failed=False,
        )
        return self.wait_exit()

    def wait_hold(self, step: int) -> None:
        """Until every rank holds after ``step`` (a checkpoint now cuts exactly there)."""

        def held(ev):
            return {e["rank"] for e in ev if e.get("event") == "hold" and e["step"] == step}

        self.wait_for(lambda ev: len(held(ev)) == self.ranks, f"every rank to hold at {step}")

    def rank_pids(self) -> list[int]:
        setup = self.of("setup")
        return sorted(r["pid"] for r in setup[0]["ranks"]) if setup else []

    def checkpoint(self, images_dir, *extra: str) -> tuple[int, dict]:
        """``cuinterpose-agent checkpoint --pid ROOT`` of this run into ``images_dir``."""
        return demo.run_agent(
            "checkpoint",
            "--pid",
            str(self.pid),
            "--images-dir",
            str(images_dir),
            "--driver",
            self.driver,
            "--control-dir",
            str(self.ctl),
            *extra,
        )

    def wait_dumped(self) -> int:
        """After the dump killed the tree: reap the root (our child, or a restored root the
        subreaper adopted) and wait until every pid of the tree is gone (so a restore finds them
        free). Returns the root's wait status (None if it was reaped elsewhere)."""
        status = None
        if self.proc.returncode is None:  # our child (the first run)
            status = self.proc.wait(timeout=HANG_S)
        pids = [self.pid, *self.rank_pids()]
        deadline = time.monotonic() + HANG_S
        while True:
            for pid, st in demo.reap_zombies():  # a restored tree, re-parented to us
                if pid == self.pid:
                    status = os.waitstatus_to_exitcode(st)
            if not [p for p in pids if os.path.exists(f"/proc/{p}")]:
                return status
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank pids {pids} still present after the dump")
            time.sleep(0.02)

    def wait_exit(self) -> Optional[int]:
        """The root's exit code: our child's (first run), or, after a restore, the restored
        root's when it was re-parented to us (the subreaper); None when it is gone without a
        status for us."""
        if self.proc.returncode is None:
            return self.proc.wait(timeout=HANG_S)
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = -1, 0
            if pid == self.pid:
                return os.waitstatus_to_exitcode(status)
            if pid == -1 and not demo.pid_alive(self.pid):
                return None
            time.sleep(0.05)
        raise RuntimeError(f"restored carw (pid {self.pid}) still running after {HANG_S:g} s")

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except Exception:
            pass
        demo.reap_zombies()


def _session(sid: int) -> list[int]:
    """The pids of session ``sid`` (proc(5) stat field 6), ``sid`` itself included."""
    out = []
    for pid in procfs.pids():
        try:
            if int(procfs.stat_fields(pid)[1][procfs.STAT_SESSION]) == sid:
                out.append(pid)
        except (OSError, IndexError, ValueError):
            pass
    return out


def check_finished(run: Carw, *, restores: int) -> dict:
    """Assert the finished run's evidence exactly: every rank completed steps 1..steps once
    each with every sum exact, its table unchanged, and (``restores``) that many restored
    resumes with VAs and table identical. Returns the summary event."""
    s = run.of("summary")
    assert len(s) == 1, (run.events()[-5:], run.stderr_tail())
    s = s[0]
    assert s["problems"] == [] and s["ok"] is True, s
    assert (s["world"], s["steps"], s["sums_exact"], s["failed_checks"]) == (
        run.ranks,
        run.steps,
        run.ranks * run.steps,
        0,
    )
    assert (s["restores_seen"], s["va_tables_identical"]) == (restores, True)
    assert s["rank_exit"] == [0] * run.ranks
    done = run.of("done")
    assert sorted(d["rank"] for d in done) == list(range(run.ranks))
    for d in done:
        assert d["sequence"] == {
            "count": run.steps,
            "distinct": run.steps,
            "first": 1,
            "last": run.steps,
            "gaps": 0,
            "duplicates": 0,
            "in_order": True,
        }, d
        assert (d["sums_exact"], d["failed"], d["table_changed"]) == (run.steps, 0, 0), d
        assert d["table_reads"] == run.steps + 1
    before = {e["rank"]: e for e in run.of("vas", after_restore=False)}
    after = run.of("vas", after_restore=True)
    assert sorted(before) == list(range(run.ranks))
    assert sorted(e["rank"] for e in after) == sorted(list(range(run.ranks)) * restores)
    keys = ("pid", "data_va", "signal_va", "table_va", "table")
    for e in after:
        assert {k: e[k] for k in keys} == {k: before[e["rank"]][k] for k in keys}
    # every table row r holds rank r's data and signal VAs as that rank opened them: its own
    # row is its own VAs, and no two ranks' rows for a peer name the same VA twice
    for r, e in before.items():
        assert e["table"][r] == [e["data_va"], e["signal_va"]]
        assert len({tuple(row) for row in e["table"]}) == run.ranks
    return s
