"""``CUINTERPOSE_TEST_SIGNAL_AT`` (agent/mech/signal_at.py): the agent signals itself at a step
boundary (``before``/``after``, from the step runner) or inside a step's blocking call
(``during``), once per entry; a malformed entry is an error naming the variable and the known
steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import quiesce, signal_at
from cuinterpose.agent.run.checkpoint import Checkpoint
from cuinterpose.agent.run.restore import Restore
from cuinterpose.agent.run.steps import Step, StepRunner, coordinator_events, signal_point

ENV = signal_at.ENV


class _Seq(StepRunner):
    KIND = "test"
    STEPS = (
        Step("alpha", "a", "g", "s"),
        Step("beta", "b", "g", "s"),
        Step("gamma", "c", "g", "s"),
    )

    def __init__(self, log):
        self.log = log

        class _G:
            def pending(self):
                return None

        self.guard = _G()

    def a(self):
        self.log.append("alpha ran")

    def b(self):
        self.log.append("beta ran")
        signal_point("during")

    def c(self):
        self.log.append("gamma ran")


@pytest.fixture
def recorded(monkeypatch):
    """SIGTERM/SIGINT recorded into a list (in the order they arrive) instead of killing; the
    variable's parsed entries start afresh."""
    log: list[str] = []
    monkeypatch.setattr(signal_at, "_parsed", (None, []))
    monkeypatch.setitem(signal_at.DURING, "beta", "_Seq.b")  # the test table's during point
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in old:
        signal.signal(s, lambda n, f: log.append(signal.Signals(n).name))
    yield log
    for s, h in old.items():
        signal.signal(s, h)


def test_before_after_and_during_points_fire_once_each_in_step_order(recorded, monkeypatch):
    monkeypatch.setenv(ENV, "after:alpha=SIGTERM, before:gamma=SIGINT,during:beta=SIGTERM")
    seq = _Seq(recorded)
    seq.run_steps(seq.STEPS)
    assert recorded == ["alpha ran", "SIGTERM", "beta ran", "SIGTERM", "SIGINT", "gamma ran"]
    # each entry fired once: a second run of the same table sends nothing
    recorded.clear()
    seq.run_steps(seq.STEPS)
    assert recorded == ["alpha ran", "beta ran", "gamma ran"]
    assert signal_at.current() is None  # no step is running between runs


def test_during_is_silent_outside_a_step_and_when_unset(recorded, monkeypatch):
    monkeypatch.setenv(ENV, "during:beta=SIGTERM")
    signal_point("during")  # no step running: nothing
    monkeypatch.delenv(ENV)
    seq = _Seq(recorded)
    seq.run_steps(seq.STEPS)
    assert recorded == ["alpha ran", "beta ran", "gamma ran"]


def test_an_unknown_step_is_refused_naming_the_variable_and_every_known_step(recorded, monkeypatch):
    monkeypatch.setenv(ENV, "after:native chekpoint")
    seq = _Seq(recorded)
    with pytest.raises(AgentError) as ei:
        seq.run_steps(seq.STEPS)
    assert recorded == []  # refused before the first step
    names = [s.name for s in Checkpoint.STEPS] + [s.name for s in Restore.STEPS]
    for n in [*signal_at.CLI_POINTS, *names, "alpha", "beta", "gamma"]:
        assert repr(n) in str(ei.value)
    assert str(ei.value).startswith(
        "CUINTERPOSE_TEST_SIGNAL_AT: entry 'after:native chekpoint' names unknown step "
        "'native chekpoint'; the known steps are 'request', 'result', 'images dir', 'driver', "
    )


@pytest.mark.parametrize(
    "value,message",
    [
        (
            "at:capture",
            "CUINTERPOSE_TEST_SIGNAL_AT: entry 'at:capture' is not WHEN:STEP[=SIGNAL] with WHEN "
            "one of before, after, during (test only: unset it for a real run)",
        ),
        (
            "capture",
            "CUINTERPOSE_TEST_SIGNAL_AT: entry 'capture' is not WHEN:STEP[=SIGNAL] with WHEN "
            "one of before, after, during (test only: unset it for a real run)",
        ),
        (
            "during:manifest",
            "CUINTERPOSE_TEST_SIGNAL_AT: entry 'during:manifest': step 'manifest' has no during "
            "point; the steps with one are 'quiesce', 'quiescence check', 'capture', 'native "
            "lock', 'native checkpoint', 'criu dump', 'criu restore', 'native restore', "
            "'restore shared'",
        ),
        (
            "after:capture=SIGUSR1",
            "CUINTERPOSE_TEST_SIGNAL_AT: entry 'after:capture=SIGUSR1' names signal 'SIGUSR1'; "
            "use one of SIGKILL, SIGINT, SIGTERM, SIGHUP, SIGSTOP",
        ),
    ],
)
def test_malformed_entries_are_refused(value, message):
    with pytest.raises(AgentError) as ei:
        signal_at.parse(value)
    assert str(ei.value) == message


def test_parse_defaults_to_sigkill_and_knows_both_tables():
    assert signal_at.parse("after:capture,during:criu restore=SIGINT") == [
        ("after", "capture", signal.SIGKILL),
        ("during", "criu restore", signal.SIGINT),
    ]


def test_sigkill_after_a_step_kills_the_process_there(tmp_path):
    """The default signal in a real process: the first two steps ran, the third never did."""
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from test_signal_at import _Seq
        log = []
        seq = _Seq(log)
        seq.a = lambda: print("alpha ran", flush=True)
        seq.b = lambda: print("beta ran", flush=True)
        seq.c = lambda: print("gamma ran", flush=True)
        seq.run_steps(seq.STEPS)
        """
    )
    env = {**os.environ, ENV: "after:beta"}
    res = subprocess.run(
        [sys.executable, "-c", script, os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == -signal.SIGKILL
    assert res.stdout == "alpha ran\nbeta ran\n"


def test_during_the_quiesce_wait_fires_once_the_request_is_out(recorded, monkeypatch, tmp_path):
    """``wait_ready``'s ``during`` point: the request is on disk when the signal comes, and the
    guard's ``stop`` then cancels the request (SIGINT at that point)."""
    monkeypatch.setenv(ENV, "during:quiesce=SIGINT")
    quiesce.request(tmp_path, [77], "q1", 1000)
    seen = []

    def stop():
        seen.append(list(recorded))
        return "SIGINT" if "SIGINT" in recorded else None

    signal_at.set_current("quiesce")
    try:
        with pytest.raises(AgentError) as ei:
            quiesce.wait_ready(tmp_path, [77], "q1", 60_000, stop=stop)
    finally:
        signal_at.set_current(None)
    assert seen[0] == ["SIGINT"]
    assert str(ei.value) == (
        "quiesce: interrupted by SIGINT; checkpoint cancelled, nothing was torn down, "
        "the workload keeps running"
    )
    assert not (tmp_path / "quiesce-77.request").exists()


def test_during_a_helper_fires_once_the_child_has_execd_and_traces(recorded, monkeypatch):
    """``after_exec``: the signal comes while the helper runs, once it has exec'd and traces a
    process (here ``cat`` on a pipe that the signal handler closes, so the helper ends only
    because the signal came; its tracing is what ``_tracees`` says: pid 1 once asked about
    the child that exec'd ``cat``)."""
    monkeypatch.setenv(ENV, "during:criu dump=SIGTERM")
    asked = []

    def tracees(pid):
        asked.append(os.readlink(f"/proc/{pid}/exe"))
        return [1]

    monkeypatch.setattr(signal_at, "_tracees", tracees)
    r, w = os.pipe()

    def on_term(n, f):
        recorded.append("SIGTERM")
        os.close(w)

    signal.signal(signal.SIGTERM, on_term)
    signal_at.set_current("criu dump")
    try:
        signal_at.signal_point("during", after_exec=True)
        res = subprocess.run(["cat"], stdin=r, capture_output=True)
    finally:
        signal_at.set_current(None)
        os.close(r)
    assert (res.returncode, recorded) == (0, ["SIGTERM"])
    assert [os.path.basename(x) for x in asked] == ["cat"]


def test_coordinator_events_fire_at_the_first_reply_of_a_mutating_phase(recorded, monkeypatch):
    from cuinterpose.coordinator.results import PhaseEvent

    monkeypatch.setenv(ENV, "during:capture=SIGTERM")
    got = []
    cb = coordinator_events(lambda ev: got.append((ev.kind, ev.phase, list(recorded))))
    signal_at.set_current("capture")
    try:
        cb(PhaseEvent("reply", "INSPECT", 1, 1, 2, pid=5))
        cb(PhaseEvent("reply", "SAVE_ALLOCATIONS", 2, 1, 2, pid=5))
        cb(PhaseEvent("reply", "SAVE_ALLOCATIONS", 2, 2, 2, pid=6))
    finally:
        signal_at.set_current(None)
    assert got == [
        ("reply", "INSPECT", []),
        ("reply", "SAVE_ALLOCATIONS", ["SIGTERM"]),
        ("reply", "SAVE_ALLOCATIONS", ["SIGTERM"]),
    ]


def test_the_step_tables_hold_every_step_property():
    """Issue 27: the properties that lived in lists beside the tables (durable.POLLED,
    rollback.LOCKED_BEFORE_CAPTURE, the classes' and group.py's POINT_OF_NO_RETURN,
    signal_at.DURING) are columns of the rows, and the runner learns both tables' step names
    without importing the sequences (steps.py is imported alone in a fresh interpreter)."""
    assert [s.name for s in Checkpoint.STEPS if s.locks] == ["quiescence check"]
    assert (Checkpoint.point_of_no_return(), Restore.point_of_no_return()) == ("finish", "resume")
    assert signal_at.DURING == {
        s.name: s.during for t in (Checkpoint.STEPS, Restore.STEPS) for s in t if s.during
    }
    assert set(signal_at.DURING) == {
        "quiesce",
        "quiescence check",
        "capture",
        "native lock",
        "native checkpoint",
        "criu dump",
        "criu restore",
        "native restore",
        "restore shared",
    }
    code = textwrap.dedent(
        """
        import sys
        from cuinterpose.agent.mech import signal_at
        from cuinterpose.agent.run import steps
        names = signal_at.known_steps()
        assert "criu restore" in names and "native checkpoint" in names, names
        loaded = {"cuinterpose.agent.run.checkpoint", "cuinterpose.agent.run.restore"}
        assert not loaded & set(sys.modules), loaded & set(sys.modules)
        print(len(names))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    tables = {s.name for s in Checkpoint.STEPS} | {s.name for s in Restore.STEPS}
    assert int(out.stdout) == len(tables) + len(signal_at.CLI_POINTS)
