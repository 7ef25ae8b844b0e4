"""Fixtures of the conformance suite (tests/conformance: NVIDIA's documented checkpoint behaviour,
on any driver).

Which driver: ``CONFORMANCE_DRIVER`` = ``fake`` (default: fakecuda, its ``cuda-checkpoint``) or
``real`` (the machine's ``libcuda.so.1`` and the ``cuda-checkpoint`` on ``$PATH``; every test
skips, saying why, without a usable GPU). scripts/gpu-check.sh runs the suite with ``real``.
Which targets: ``CONFORMANCE_SHIM`` = ``both`` (default: every target test runs once plain and
once under the shim), ``plain`` or ``shim``. Controllers never run under the shim.

- ``target(dev=0, launcher=(), stderr=None, **env)``: a started ``c/ck_target.c`` on ordinal
  ``dev`` (``init`` done), run through ``launcher`` (e.g. ``cuda-checkpoint --launch-job``);
  ``t.cmd("check")`` -> the reply words; ``t.pid``.
- ``ctl(*ops, mode="bindings")``: ``ck_controller.py`` on the driver -> its JSON list.
- ``cli(*args, env=None)``: the ``cuda-checkpoint`` utility -> (status, stdout, stderr).
- ``driver_env``: a child's environment on the driver, without the shim.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from conformance_driver import DRIVER

from cuinterpose.agent import paths

HERE = pathlib.Path(__file__).resolve().parent

SHIM_MODES = {"both": ("plain", "shim"), "plain": ("plain",), "shim": ("shim",)}[
    os.environ.get("CONFORMANCE_SHIM", "both")
]


class Target:
    """ck_target.c as a line-driven child."""

    def __init__(self, argv, env, dev: int, stderr=None):
        self.proc = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            text=True,
        )
        self.pid = self.proc.pid
        assert self.cmd(f"init {dev}") == []

    def cmd(self, line: str) -> list[str]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline().split()
        assert out and out[0] == "ok", f"{line!r} -> {out or 'exit ' + str(self.proc.poll())}"
        return out[1:]

    def close(self):
        """Quit; a target a failed test left locked or checkpointed (its calls park) is killed."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def driver_base():
    """The environment of a child on the chosen driver (no shim, no control dir yet)."""
    if DRIVER == "real":
        env = paths.real_driver_env()
        res = subprocess.run(
            [sys.executable, str(HERE / "ck_controller.py"), "bindings", "init"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if res.returncode != 0 or json.loads(res.stdout) != ["CUDA_SUCCESS"]:
            pytest.skip(f"no usable NVIDIA driver here: {(res.stdout + res.stderr).strip()[-200:]}")
        return env
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKECUDA_", "CUDA_VISIBLE"))}
    env.pop("LD_PRELOAD", None)
    env.pop("CUDA_CHECKPOINT_JOB_FILE", None)
    env["LD_LIBRARY_PATH"] = str(paths.fakecuda_dir())
    return env


@pytest.fixture
def driver_env(driver_base, tmp_path):
    env = dict(driver_base, PYTHONUNBUFFERED="1")
    if DRIVER == "fake":
        env["FAKECUDA_LOG"] = str(tmp_path / "fakecuda.log")
    return env


@pytest.fixture(scope="session")
def ck_target_exe(build_c):
    return build_c([HERE / "c" / "ck_target.c"], "ck_target", libs=("-ldl",))


@pytest.fixture(params=SHIM_MODES)
def shim_mode(request):
    return request.param


@pytest.fixture
def target_env(driver_env, shim_mode, tmp_path):
    env = dict(driver_env)
    if shim_mode == "shim":
        ctl = tmp_path / "ctl"
        ctl.mkdir(exist_ok=True)
        env["LD_PRELOAD"] = str(paths.shim_path())
        env["CUINTERPOSE_CONTROL_DIR"] = str(ctl)
    return env


@pytest.fixture
def target(ck_target_exe, target_env):
    started = []

    def start(dev: int = 0, launcher=(), stderr=None, **extra):
        env = dict(target_env)
        for k, v in extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        t = Target([*launcher, ck_target_exe], env, dev, stderr)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


@pytest.fixture
def ctl(driver_env):
    def run(*ops, mode="bindings", env=None):
        res = subprocess.run(
            [sys.executable, str(HERE / "ck_controller.py"), mode, *map(str, ops)],
            env=dict(driver_env, **(env or {})),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    return run


@pytest.fixture(scope="session")
def cli_path():
    if DRIVER == "real":
        exe = shutil.which("cuda-checkpoint")
        if not exe:
            pytest.skip("no cuda-checkpoint on $PATH")
        return exe
    from cuinterpose.agent.mech import native_cli

    exe = native_cli.fake_cli()
    assert exe, "fakecuda's cuda-checkpoint is not built (make build)"
    return exe


@pytest.fixture
def cli(cli_path, driver_env):
    def run(*args, env=None):
        res = subprocess.run(
            [cli_path, *map(str, args)],
            env=dict(driver_env, **(env or {})),
            capture_output=True,
            text=True,
            timeout=120,
        )
        return res.returncode, res.stdout, res.stderr

    return run


@pytest.fixture(scope="session")
def cli_help(cli_path, driver_base):
    return subprocess.run(
        [cli_path, "--help"], env=driver_base, capture_output=True, text=True, timeout=60
    ).stdout
