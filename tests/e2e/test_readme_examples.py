"""The README's agent examples that run on fakecuda, run as the README writes them (issue 27:
one option has one name and meaning in every command, and the README's commands are true).

The fakecuda block (``doctor --driver fake``, afdwin launched and held, ``inspect --driver
fake``, ``checkpoint``, ``snapshots --dir``, ``restore``, the job's summary) and then the daemon
block (``serve --driver fake --control-dir ...``, ``health``, ``checkpoint``, ``snapshots`` and
``restore`` through ``--agent``) on a second job started by the fakecuda block's own lines, are
taken from README.md's text and run by bash in a scratch directory. The test asserts both jobs'
evidence (every message 1..2000 exactly once, the VAs unchanged across the restore) and what
each command printed. Also: ``inspect`` reports the driver's state of the process with
``--driver fake``, ``CUINTERPOSE_DRIVER=fake`` and through a daemon alike."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from cuinterpose.workloads.afdwin import demo

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
STEPS = 2000  # what the README's afdwin runs


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)


def block(marker: str) -> str:
    found = [b for b in sh_blocks() if marker in b]
    assert len(found) == 1, f"README: {len(found)} sh blocks hold {marker!r}"
    return found[0]


def start_lines(fake: str) -> str:
    """The fakecuda block's lines that start a held afdwin and wait for its two ranks (from
    its ``export CUINTERPOSE_CONTROL_DIR`` to the wait for the sockets), ``doctor`` left out,
    the log renamed so that the two jobs' evidence stays apart."""
    lines = fake.splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.startswith("export CUINTERPOSE_CONTROL_DIR"))
    last = next(i for i, ln in enumerate(lines) if "cuinterpose-*.sock" in ln)
    keep = [ln for ln in lines[first : last + 1] if "doctor" not in ln]
    return "\n".join(keep).replace("afdwin.log", "afdwin2.log")


SUBREAPER = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(36, 1, 0, 0, 0); "
    "os.execv('/bin/bash', ['bash', sys.argv[1]])"
)


def events(path: pathlib.Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_the_readme_fakecuda_and_daemon_examples_run_as_written(criu_ok):
    fake = block("export CUINTERPOSE_CONTROL_DIR=$(mktemp -d)")
    daemon = block("serve --listen $SOCK --snapshot-dir $W/snapshots --driver fake")
    gpu = block("A=.venv/bin/cuinterpose-agent")
    a_line = next(ln for ln in gpu.splitlines() if ln.startswith("A="))
    # short paths: the control sockets' names must fit sun_path (107 bytes)
    work = pathlib.Path(tempfile.mkdtemp(prefix="cui-readme-"))
    try:
        (work / ".venv").symlink_to(ROOT / ".venv")
        script = work / "readme.sh"
        script.write_text(
            "set -euo pipefail\n"
            f"{a_line.split('#')[0].strip()}\n"
            f"{fake}\n"
            "echo '== the daemon example, on a second job started as above'\n"
            "rm -f afdwin.pid\n"
            f"{start_lines(fake)}\n"
            f"{daemon}\n"
            "SERVE=$!\n"
            "while kill -0 $ROOT 2>/dev/null; do sleep 1; done\n"
            "kill $SERVE; wait $SERVE || true\n"
            "grep '\"summary\"' afdwin2.log\n"
        )
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
        env.update(TMPDIR=str(work))
        env.pop("CUINTERPOSE_CONTROL_DIR", None)
        env.pop("CUINTERPOSE_DRIVER", None)
        res = subprocess.run(
            [sys.executable, "-c", SUBREAPER, str(script)],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=1800,  # a hang only: the two jobs take well under a minute
        )
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-6000:]
        # doctor, inspect (the rank's native state through --driver fake), snapshots, restore
        assert "ok   driver: fake driver" in out, out[-6000:]
        assert re.search(r"native: RUNNING \(fake driver, driver-api\)", out), out[-6000:]
        assert re.search(r"snapshot \S+ written to \S+/afdwin-snap", out), out[-6000:]
        assert "afdwin-snap" in out.split("written to", 1)[1], out[-6000:]
        assert out.count("restored ") == 2, out[-6000:]  # in-process and through the daemon
        assert re.search(r"snapshot \S+ written to \S+/snapshots/job1", out), out[-6000:]
        for log in ("afdwin.log", "afdwin2.log"):
            assert demo.check_run(events(work / log), STEPS) == [], log
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _inspect(pid, *args, env=None):
    e = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUINTERPOSE_DRIVER")}
    e.update(env or {})
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "inspect", "--pid", str(pid), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=e,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_inspect_driver_is_one_option_everywhere(afdwin, tmp_path):
    """``inspect --driver fake``, ``CUINTERPOSE_DRIVER=fake inspect`` and ``inspect --agent``
    of a daemon ``serve --driver fake`` report the same native state of a rank."""
    a = afdwin(steps=400, step_delay_ms=0, ranks=2, attention=1, hold_at=(20,))
    a.wait_hold(1)
    rank = sorted(int(p.name[len("cuinterpose-") : -len(".sock")]) for p in a.ctl.glob("*.sock"))[0]
    want = {"state": "RUNNING", "backend": "driver-api", "driver": "fake"}
    by_flag = _inspect(rank, "--driver", "fake", "--control-dir", str(a.ctl), "--json")
    assert (by_flag["ok"], by_flag["native"]) == (True, want)
    by_env = _inspect(
        rank, "--control-dir", str(a.ctl), "--json", env={"CUINTERPOSE_DRIVER": "fake"}
    )
    assert by_env["native"] == want
    assert by_env["records"] == by_flag["records"]
    sock = f"unix:{tempfile.mkdtemp(prefix='cui-insp-')}/a.sock"
    e = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    srv = subprocess.Popen(
        [sys.executable, "-m", "cuinterpose.agent.cli", "serve", "--listen", sock]
        + ["--snapshot-dir", str(tmp_path / "s"), "--driver", "fake", "--control-dir", str(a.ctl)]
        + ["--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=e,
    )
    try:
        ready = json.loads(srv.stdout.readline())
        assert ready["ok"], ready
        by_daemon = _inspect(rank, "--agent", sock, "--json")
        assert by_daemon["native"] == want
        assert by_daemon["records"] == by_flag["records"]
    finally:
        srv.terminate()
        srv.wait(timeout=120)
    a.release_hold()
    a.wait_ok(600)


@pytest.mark.parametrize("how", ["arg", "dir"])
def test_snapshots_takes_its_directory_as_arg_or_dir_and_says_where(tmp_path, how):
    """``snapshots PATH`` and ``snapshots --dir PATH`` are one option; an empty root lists
    nothing, a missing one is refused naming it."""
    root = tmp_path / "snaps"
    root.mkdir()
    args = [str(root)] if how == "arg" else ["--dir", str(root)]
    rc, out = demo.run_agent("snapshots", *args)
    assert (rc, out["ok"], out["dir"], out["snapshots"]) == (0, True, str(root), [])
    rc, out = demo.run_agent("snapshots", *(["--dir"] if how == "dir" else []), str(root / "x"))
    assert (rc, out["error"]["phase"]) == (3, "snapshots"), out
    assert out["error"]["reason"].startswith(f"{root / 'x'} cannot be read: ")
