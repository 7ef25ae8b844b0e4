"""Every CRIU run has a deadline (issue 11 item 2): the run's ``criu_timeout_s`` option
(``--criu-timeout-s``, ``$CUINTERPOSE_CRIU_TIMEOUT_S``, default 3600 s); past it CRIU is
killed and the step fails with a CriuError naming the deadline, the option and the images
dir. A stand-in CRIU that never ends shows it (the deadline is the event under test, not a
timing assertion: the test only needs it to fire at some point)."""

from __future__ import annotations

import os
import sys

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import criu, criu_run
from cuinterpose.agent.mech.criu_binary import CriuError
from cuinterpose.agent.options import RunOptions

FINITE = "must be a finite number of seconds above 0 and at most 86400"
HANGS = [
    sys.executable,
    "-c",
    "import os, time; open(os.environ['PIDFILE'], 'w').write(str(os.getpid())); time.sleep(600)",
]


def test_a_criu_run_past_its_deadline_is_killed_and_named(tmp_path, monkeypatch):
    pidfile = tmp_path / "criu.pid"
    monkeypatch.setenv("PIDFILE", str(pidfile))
    monkeypatch.setattr(criu_run, "criu_command", lambda: list(HANGS))
    monkeypatch.setattr(criu_run, "env", lambda: {"PIDFILE": str(pidfile)})
    images = tmp_path / "images"
    images.mkdir()
    with pytest.raises(CriuError) as ei:
        criu_run.run(
            "dump", ["-t", "1"], images_dir=images, log_path=images / "dump.log", timeout_s=0.5
        )
    assert str(ei.value).startswith(
        f"criu dump did not finish within 0.5 s (criu_timeout_s) for images dir "
        f"{images}: it was killed"
    )
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: no such process any more
        os.kill(pid, 0)


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_deadline_is_refused_by_name(raw):
    with pytest.raises(AgentError) as ei:
        RunOptions.from_environ({"CUINTERPOSE_CRIU_TIMEOUT_S": raw})
    assert (ei.value.phase, ei.value.outcome) == ("request", "refused")
    why = "must be a number of seconds" if raw == "soon" else FINITE
    assert ei.value.reason == f"$CUINTERPOSE_CRIU_TIMEOUT_S={raw!r}: {why}"


def test_the_default_deadline():
    assert RunOptions().criu_timeout_s == criu.TIMEOUT_S == 3600.0
    assert RunOptions.from_environ({"CUINTERPOSE_CRIU_TIMEOUT_S": "90"}).criu_timeout_s == 90.0
