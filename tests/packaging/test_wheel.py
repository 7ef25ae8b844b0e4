"""The wheel users install (issue 28): scripts/build-wheel.sh (``make wheel``) builds a
manylinux_2_17 wheel, and an empty virtual environment with only that wheel installed does the
main job with no checkout: ``cuinterpose-agent install-criu`` gives a CRIU that passes ``criu
check``, ``doctor --driver fake`` then reports every row ok, and the afdwin demo is
checkpointed mid-stream and restored on fakecuda with nothing lost.

Every command of the environment runs with its cwd in an empty folder outside the checkout,
``PATH`` = the environment's bin, /usr/bin and /bin (no Makefile, no .venv, no system criu in
/usr/sbin), and no ``PYTHONPATH`` or ``CUINTERPOSE_*`` variable but one: install-criu's
downloads go through the checkout's apt state (``CUINTERPOSE_CRIU_APT``, the folder ``make
criu`` fills), so the .debs are not fetched again each run; a clean clone fetches them once.

Cost: the wheel is built once per session (about 20-30 s: CMake, LTO, pip's cache for the build
requirements) and installed once (about 25 s from pip's cache, ``--no-compile``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

from cuinterpose.agent.mech import criu_binary

REPO = pathlib.Path(__file__).resolve().parents[2]
PLAT = "manylinux_2_17_x86_64"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-wheel.sh"), str(out)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stderr
    path = pathlib.Path(res.stdout.strip())
    assert path.parent == out and path.is_file(), res.stdout
    return path


class WheelEnv:
    """A virtual environment holding only the wheel and its dependencies."""

    def __init__(self, root: pathlib.Path, cwd: pathlib.Path):
        self.root, self.cwd = root, cwd
        self.bin = root / "bin"
        self.env = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "HOME": str(cwd),
            "TMPDIR": str(cwd),
            "LANG": "C.UTF-8",
            "CUINTERPOSE_CRIU_APT": str(criu_binary.cache_dir() / "apt"),
        }

    def run(self, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(a) for a in argv],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def doctor(self) -> tuple[int, dict]:
        res = self.run(self.bin / "cuinterpose-agent", "doctor", "--driver", "fake", "--json")
        return res.returncode, {c["name"]: c for c in json.loads(res.stdout)["checks"]}


@pytest.fixture(scope="session")
def wheel_env(wheel, tmp_path_factory) -> WheelEnv:
    root = tmp_path_factory.mktemp("wheel-env") / "venv"
    cwd = tmp_path_factory.mktemp("elsewhere")
    # An empty environment (no pip in it); this session's pip installs the wheel into it.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(root / "bin" / "python"),
            "install",
            "--quiet",
            "--no-compile",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert res.returncode == 0, res.stderr
    return WheelEnv(root, cwd)


@pytest.fixture(scope="session")
def criu_steps(wheel_env):
    """doctor without CRIU, install-criu, doctor again: the three results, in that order."""
    before = wheel_env.doctor()
    install = wheel_env.run(wheel_env.bin / "cuinterpose-agent", "install-criu")
    after = wheel_env.doctor()
    return before, install, after


def test_the_wheel_is_manylinux_2_17(wheel):
    assert wheel.name == f"cuinterpose-0.1.0-py3-none-manylinux2014_x86_64.{PLAT}.whl"
    show = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", str(wheel)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f'is consistent with the following platform tag: "{PLAT}"' in " ".join(show.split())
    with zipfile.ZipFile(wheel) as z:
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
    for name, exe in [
        ("cuinterpose/lib/libcuinterpose.so", False),
        ("cuinterpose/lib/fakecuda/libcuda.so.1", False),
        ("cuinterpose/lib/fakecuda/bin/cuda-checkpoint", True),
        ("cuinterpose/agent/mech/criu_install.sh", False),
        ("cuinterpose/_proto/cuinterpose/v1/agent_pb2.py", False),
    ]:
        assert name in modes and bool(modes[name] & 0o100) == exe, (name, oct(modes.get(name, 0)))
    assert not [n for n in modes if n.startswith(("tests/", "scripts/", "cuinterpose/tests"))]


def test_the_environment_imports_nothing_from_the_checkout(wheel_env):
    res = wheel_env.run(
        wheel_env.bin / "python",
        "-c",
        "import cuinterpose, sys; print(list(cuinterpose.__path__)); print(sys.path)",
    )
    pkg, path = (eval(line) for line in res.stdout.splitlines())
    site = wheel_env.root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    assert pkg == [str(site / "site-packages" / "cuinterpose")]
    assert not [p for p in path if p.startswith(str(REPO))], path


def test_doctor_names_install_criu_then_install_criu_makes_doctor_ok(wheel_env, criu_steps):
    (rc0, before), install, (rc1, after) = criu_steps
    where = wheel_env.root / "share" / "cuinterpose" / "criu"
    assert rc0 == 1 and before["criu version"]["ok"] is False
    assert (
        before["criu version"]["detail"]
        .splitlines()[-1]
        .startswith(
            f"To install one: run `cuinterpose-agent install-criu` (CRIU 4.x into {where}, found "
            "there by the agent); or install CRIU >= 4.0 yourself"
        )
    )
    assert [n for n, c in before.items() if not c["ok"]] == ["criu version", "criu check"]

    assert install.returncode == 0, install.stderr
    lines = install.stderr.splitlines()
    assert re.fullmatch(
        rf"install-criu: installed {where}/bin/criu: Version: 4\.\d+(\.\d+)?; "
        r"criu check: Looks good\.",
        lines[-2],
    ), install.stderr
    assert re.fullmatch(
        rf"install-criu: the agent uses {where}/bin/criu \(criu 4\.\d+(\.\d+)?\)", lines[-1]
    )

    assert rc1 == 0, after
    assert re.fullmatch(
        rf"criu 4\.\d+(\.\d+)? \({where}/bin/criu\)", after["criu version"]["detail"]
    )
    assert after["criu check"]["detail"] == "Looks good."
    site = wheel_env.root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    lib = site / "site-packages" / "cuinterpose" / "lib"
    assert after["shim"]["detail"].startswith(f"{lib / 'libcuinterpose.so'} sha256 ")
    assert re.match(
        rf"fake driver \d+ at {lib / 'fakecuda' / 'libcuda.so.1'}; ", after["driver"]["detail"]
    ), after["driver"]


def test_afdwin_checkpoint_and_restore_from_the_wheel(wheel_env, criu_steps):
    """The demo harness of the installed package: afdwin under the installed shim on the
    installed fakecuda, `cuinterpose-agent checkpoint` mid-stream and `restore`, every message
    delivered once and every VA the same."""
    run = wheel_env.cwd / "demo-run"
    res = wheel_env.run(
        wheel_env.bin / "python", "-m", "cuinterpose.workloads.afdwin.demo", "--run-dir", run
    )
    last = res.stdout.strip().splitlines()[-1]
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.match(
        r"demo: PASS messages before cut=(\d+) after cut=(\d+) lost=0 duplicated=0 torn=0 "
        r"VAs identical; ",
        last,
    )
    assert m, last
    before, after = int(m.group(1)), int(m.group(2))
    assert 0 < before < 400 and before + after == 400
    manifest = json.loads((run / "snapshot" / "manifest.json").read_text())
    assert len(manifest["processes"]) == 3, manifest.keys()  # the launcher and its two ranks
