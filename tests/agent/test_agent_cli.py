"""The command line as an operator meets it: --json on every path, exit codes, and helpers
(CRIU) started without the shim."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from cuinterpose.agent import demo, paths


def test_json_usage_error_is_one_json_object_exit_2(tmp_path):
    rc, out = demo.run_agent("checkpoint", "--images-dir", str(tmp_path / "snap"))
    assert rc == 2
    assert out == {"ok": False, "error": {"phase": "usage", "pid": None, "outcome": "usage",
                                          "reason": "Missing option '--pid'.",
                                          "message": "usage: Missing option '--pid'."}}


def test_unusable_images_dir_is_refused_exit_3(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, out = demo.run_agent("checkpoint", "--pid", str(os.getpid()), "--images-dir",
                             str(f / "snap"), "--driver", "fake", "--control-dir", str(tmp_path))
    assert rc == 3 and out["ok"] is False
    e = out["error"]
    assert (e["phase"], e["pid"], e["outcome"]) == ("images dir", None, "refused")
    assert e["reason"] == f"{f / 'snap'} cannot be created: Not a directory"
    assert out["phases"] == []
    assert f.read_text() == "x"


def test_restore_refusal_hint_speaks_of_the_snapshot(tmp_path):
    res = subprocess.run([sys.executable, "-m", "cuinterpose.agent.cli", "restore",
                          "--images-dir", str(tmp_path), "--driver", "fake"],
                         capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                              if k != "LD_PRELOAD"})
    assert res.returncode == 3
    assert res.stderr.splitlines()[-1] == ("outcome: refused: nothing was changed; the snapshot "
                                           "is untouched")


def test_helpers_run_without_ld_preload_and_the_agent_not_under_the_shim(tmp_path):
    """Started with LD_PRELOAD=<shim> (as from a preloaded shell), the agent re-executes itself
    without the shim (it opens no control socket of its own) and CRIU gets no LD_PRELOAD."""
    rec = tmp_path / "env"
    rec.mkdir()
    fake_criu = tmp_path / "criu"
    # records its environment and whether its parent (the agent) maps the shim
    fake_criu.write_text(f'#!/bin/sh\nenv > "{rec}/env.$$"\n'
                         f'grep -c {paths.SHIM_NAME} /proc/$PPID/maps > "{rec}/maps.$$"\n'
                         'echo "Version: 4.1.0"\necho "Looks good."\n')
    fake_criu.chmod(0o755)
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    env = dict(os.environ, LD_PRELOAD=str(paths.shim_path()), CUINTERPOSE_CRIU=str(fake_criu),
               LD_LIBRARY_PATH=str(paths.fakecuda_dir()))
    res = subprocess.run([sys.executable, "-m", "cuinterpose.agent.cli", "doctor", "--json",
                          "--driver", "fake", "--control-dir", str(ctl)],
                         capture_output=True, text=True, env=env, timeout=120)
    out = json.loads(res.stdout)
    checks = {c["name"]: c for c in out["checks"]}
    assert checks["criu version"]["ok"] and checks["criu check"]["ok"], out
    envs = [p.read_text().splitlines() for p in sorted(rec.glob("env.*"))]
    assert len(envs) >= 2     # `criu check` and `criu --version` at least
    assert {p.read_text().strip() for p in rec.glob("maps.*")} == {"0"}
    for lines in envs:
        assert not any(line.startswith(("LD_PRELOAD=", "LD_LIBRARY_PATH=")) for line in lines)
    assert sorted(p.name for p in ctl.iterdir()) == []


def test_doctor_lines_are_not_wrapped_when_stdout_is_not_a_tty(tmp_path):
    """A log or a pipe gets each check on one line: paths and hashes stay greppable. Without
    CRIU the CRIU checks fail and doctor exits 1."""
    from cuinterpose.agent.census import ShimFile
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["CUINTERPOSE_CRIU"] = str(tmp_path / "no-criu-here")
    res = subprocess.run([sys.executable, "-m", "cuinterpose.agent.cli", "doctor", "--driver",
                          "fake", "--control-dir", str(tmp_path / "ctl")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1
    s = ShimFile.of(paths.shim_path())
    lines = res.stdout.splitlines()
    assert f"ok   shim: {s.path} sha256 {s.sha256}" in lines
    assert f"ok   control dir: {tmp_path / 'ctl'} writable" in lines
    assert lines[0] == ("FAIL criu version: no working CRIU; install one with `make criu` (bash "
                        "scripts/install-criu.sh):")


def test_non_positive_timeouts_are_usage_errors(tmp_path):
    rc, out = demo.run_agent("restore", "--images-dir", str(tmp_path), "--carrier-timeout-s", "0")
    assert rc == 2
    assert out["error"]["reason"] == ("Invalid value for '--carrier-timeout-s': 0.0 is not in "
                                      "the range x>0.")
