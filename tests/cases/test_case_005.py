"""Case 005 (shared/cases/005-dlsym-preload-order), kind: another dlsym-interposing library
preloaded before the shim silently bypasses tracking.

At cuInit the shim notices that the dlsym the process resolves is not its own, says so once on
stderr (what to do: put libcuinterpose.so first), and every reply, INSPECT's included, carries
CUI_SHIM_FOREIGN_DLSYM in shim_flags for the coordinator and agent to show; INSPECT refuses
(issue 24: lookups through the other dlsym bypass the shim, so a capture would miss their
memory). With the shim first, nothing is said, the flag is clear and INSPECT answers OK.
(docs/shim.md "Preload order".)
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from shim.conftest import C_BUILD_DIR, apps, build_shared, ctl, shim_env, vmm_app  # noqa: E402, F401

from cuinterpose.coordinator.protocol import Op, Phase, ShimFlag, Status  # noqa: E402
from cuinterpose.workloads.afdwin import demo  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def _libother():
    return build_shared([HERE / "c" / "other_dlsym.c"], C_BUILD_DIR / "libother_dlsym.so", ["-O1"])


def _inspect(ctl, a):  # noqa: F811
    r = ctl(a).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    return r.reply.status, r.message, r.reply.shim_flags


def test_foreign_dlsym_first_is_reported(apps, shim_env, ctl):  # noqa: F811
    other = _libother()
    env = dict(shim_env)
    env["LD_PRELOAD"] = f"{other}:{shim_env['LD_PRELOAD']}"
    a = apps(env=env)
    a.ok("init")
    a.ok("init")  # a second cuInit says nothing more
    err = a.stderr()
    want = (
        f"cuinterpose[{a.pid}]: cuInit: pid {a.pid} (phase ACTIVE): dlsym resolves to {other}, "
        "not to libcuinterpose: another dlsym interposer is preloaded before the shim, so dlsym, "
        "cuGetProcAddress and ctypes lookups through it bypass tracking and a checkpoint may be "
        'refused; put libcuinterpose.so first in LD_PRELOAD (docs/shim.md "Preload order")'
    )
    assert want in err, err
    assert err.count("dlsym resolves to") == 1
    # with the flags every shim of D36 and D70 on carries (it takes CUI_CARRY_SHA256 and
    # CUI_CARRY_STREAMED); the capture is refused
    assert _inspect(ctl, a) == (
        Status.REFUSED_STATE,
        f"INSPECT: pid {a.pid}: dlsym resolves to {other}, not to libcuinterpose: lookups through it (dlsym, "
        "cuGetProcAddress, ctypes) bypass the shim, so this process may hold CUDA memory the checkpoint would "
        "miss; nothing was changed: put libcuinterpose.so first in LD_PRELOAD",
        ShimFlag.FOREIGN_DLSYM | ShimFlag.CARRY_SHA256 | ShimFlag.CARRY_STREAMED,
    )


def test_shim_first_is_quiet(apps, shim_env, ctl):  # noqa: F811
    other = _libother()
    env = dict(shim_env)
    env["LD_PRELOAD"] = f"{shim_env['LD_PRELOAD']}:{other}"
    a = apps(env=env)
    a.ok("init")
    assert "dlsym resolves to" not in a.stderr()
    assert _inspect(ctl, a) == (
        Status.OK,
        "",
        ShimFlag.CARRY_SHA256 | ShimFlag.CARRY_STREAMED,
    )  # no FOREIGN_DLSYM


PY_CTYPES_APP = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")          # ctypes: dlsym(handle, name) for every function
assert cuda.cuInit(0) == 0
print("ready", flush=True)
sys.stdin.readline()
"""


def test_python_ctypes_behind_a_foreign_dlsym_is_refused_by_the_census(shim_env, tmp_path):  # noqa: F811
    """From Python the other dlsym hands ctypes the driver's cuInit too: the shim never starts,
    nothing can warn inside the process. The agent's census refuses the CUDA process without a
    control socket and names the library ahead of the shim in its LD_PRELOAD."""
    other = _libother()
    env = dict(shim_env, LD_PRELOAD=f"{other}:{shim_env['LD_PRELOAD']}")
    p = subprocess.Popen(
        [sys.executable, "-c", PY_CTYPES_APP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        ctl = shim_env["CUINTERPOSE_CONTROL_DIR"]
        rc, cp = demo.run_agent(
            "checkpoint",
            "--pid",
            str(p.pid),
            "--images-dir",
            str(tmp_path / "snap"),
            "--driver",
            "fake",
            "--control-dir",
            ctl,
        )
        assert rc != 0 and cp["ok"] is False
        msg = cp["error"]["message"]
        assert (
            f"is a CUDA process with the shim mapped but no control socket {ctl}/cuinterpose-{p.pid}.sock"
            in msg
        )
        assert (
            f"its LD_PRELOAD puts {other} before the shim: a library there that overrides dlsym lets cuInit "
            'and every lookup bypass it (put libcuinterpose.so first, docs/shim.md "Preload order")'
        ) in msg
    finally:
        p.kill()
        p.wait()
